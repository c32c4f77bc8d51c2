"""Bearer-key authentication of the API routes."""

from __future__ import annotations

import hmac

from diffserve.errors import error_response, unauthorized


class BearerAuth:
    """``Authorization: Bearer <key>`` on /v1/*; /health, /metrics and the page stay open.
    A plain ASGI middleware, so it does not get between a handler and disconnect events."""

    def __init__(self, app, key: str) -> None:
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            # compare_digest: the time taken does not tell how much of a guess was right.
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                await error_response(unauthorized())(scope, receive, send)
                return
        await self.app(scope, receive, send)
