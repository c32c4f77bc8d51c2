"""Errors a client can see, and their mapping to HTTP, in one place.

Every error body has the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class APIError(Exception):
    message: str
    param: str | None = None
    code: str | None = None
    status: int = 400
    type: str = "invalid_request_error"
    headers: dict[str, str] | None = None

    def __str__(self) -> str:
        return self.message

    @property
    def outcome(self) -> str:
        """How the request counts in the metrics: rejected (429), invalid (4xx) or failed."""
        return "rejected" if self.status == 429 else "invalid" if self.status < 500 else "failed"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def error_response(error: APIError):
    """The HTTP response of an error: its status, its headers and the OpenAI error body."""
    from starlette.responses import JSONResponse

    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, param, code, 400, "invalid_request_error")


def model_not_found(name: str, served: str | list[str], adapters=(),
                    param: str = "model") -> APIError:
    """``served``: the model's name, or the names of the several models served."""
    also = f" and the LoRA adapters {', '.join(map(repr, sorted(adapters)))}" if adapters else ""
    served = ", ".join(map(repr, served)) if isinstance(served, list) else repr(served)
    return APIError(f"The model {name!r} does not exist; this server serves {served}{also} "
                    "(GET /v1/models lists them).", param, "model_not_found", 404,
                    "invalid_request_error")


def not_found(path: str) -> APIError:
    return APIError(f"No route {path}.", None, "not_found", 404, "invalid_request_error")


def method_not_allowed(method: str, path: str) -> APIError:
    return APIError(f"Method {method} is not allowed on {path}.", None, "method_not_allowed", 405,
                    "invalid_request_error")


def unavailable(message: str, code: str = "service_unavailable") -> APIError:
    return APIError(message, None, code, 503, "server_error")


def engine_error(status: int, message: str, type: str = "server_error",
                 code: str | None = None) -> APIError:
    """An error answered by the scheduler or executor for one request."""
    # 429 means "try again soon": the queue drains in about a batch time.
    headers = {"Retry-After": "1"} if status == 429 else None
    return APIError(message, None, code, status, type, headers)


def forbidden(message: str, param: str | None = None) -> APIError:
    return APIError(message, param, "permission_denied", 403, "invalid_request_error")


def unauthorized() -> APIError:
    return APIError("Missing or invalid API key. Send 'Authorization: Bearer <key>'.", None,
                    "invalid_api_key", 401, "invalid_request_error",
                    {"WWW-Authenticate": "Bearer"})


def body_too_large(limit: int, flag: str) -> APIError:
    return APIError(f"The request body is larger than {limit} bytes ({flag}).", None,
                    "request_too_large", 413, "invalid_request_error")


def internal_error(message: str = "The server had an internal error while processing the "
                   "request.") -> APIError:
    return APIError(message, None, "internal_error", 500, "server_error")
