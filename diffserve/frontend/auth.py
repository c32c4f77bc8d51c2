"""Bearer-key authentication of the API routes."""

from __future__ import annotations

import hmac

from diffserve.errors import error_response, unauthorized


PRIORITY = "key_priority"  # where a request's key leaves its priority class: request.state


class BearerAuth:
    """``Authorization: Bearer <key>`` on /v1/*; /health, /metrics and the page stay open. The
    key's priority class, if it has one, goes on to the route in the request's state. A plain
    ASGI middleware, so it does not get between a handler and disconnect events."""

    def __init__(self, app, keys: dict[str, int | None]) -> None:
        self.app = app
        self.keys = [(key.encode(), priority) for key, priority in keys.items()]

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            token = token.strip()
            # compare_digest, against every key: the time taken tells neither how much of a
            # guess was right nor which key it came close to.
            matches = [priority for key, priority in self.keys
                       if hmac.compare_digest(token, key)]
            if scheme.lower() != b"bearer" or not matches:
                await error_response(unauthorized())(scope, receive, send)
                return
            scope.setdefault("state", {})[PRIORITY] = matches[0]
        await self.app(scope, receive, send)
