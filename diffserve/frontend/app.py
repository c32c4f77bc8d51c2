"""The HTTP API: OpenAI-style images endpoints, models, health and metrics.

Every error leaves through :func:`error_response`, the one place where errors become HTTP.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import orjson
from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from diffserve import metrics as metrics_module
from diffserve.config import ServerConfig
from diffserve.errors import (
    APIError,
    body_too_large,
    internal_error,
    invalid_request,
    method_not_allowed,
    not_found,
    unauthorized,
    unavailable,
)
from diffserve.frontend.encode import encode_images
from diffserve.frontend.engine_client import EngineClient
from diffserve.frontend.schemas import ImageGenerationRequest, ModelCard, ModelList
from diffserve.frontend.validation import to_engine_request


class OrjsonResponse(JSONResponse):
    """Large base64 payloads: orjson serialises them several times faster than json."""

    def render(self, content) -> bytes:
        return orjson.dumps(content)


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def validation_error(errors: list[dict]) -> APIError:
    """The first pydantic complaint, phrased with the offending parameter."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        return invalid_request("We could not parse the JSON body of your request. The body must "
                               "be a JSON object.", None, "invalid_json")
    if kind == "extra_forbidden":
        return invalid_request(f"Unknown parameter: {param!r}.", param, "unknown_parameter")
    if kind == "missing":
        return invalid_request(f"Missing required parameter: {param!r}.", param,
                               "missing_required_parameter")
    if kind == "model_attributes_type" or not param:
        return invalid_request("The request body must be a JSON object.", None, "invalid_type")
    return invalid_request(f"Invalid value for {param!r}: {first.get('msg', 'invalid')}.", param,
                           "invalid_value")


def _json_body(model: type[BaseModel]) -> dict:
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": model.model_json_schema(ref_template="#/components/schemas/{model}")}}}}


async def parse_body(request: Request, model: type[BaseModel], limit: int) -> BaseModel:
    """Parse the body as JSON whatever its content type (``curl -d`` sends form encoding)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise body_too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise validation_error([{"type": "json_invalid"}]) from None
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise validation_error(error.errors()) from None


class BearerAuth:
    """``Authorization: Bearer <key>`` on /v1/*; /health and /metrics stay open for probes.
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


async def until_disconnected(request: Request, work):
    """Await ``work``, unless the client disconnects first: then cancel it and return None.

    After the body is read, the ASGI ``receive`` only returns on disconnect, so waiting on it is
    an event, not a poll."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return None


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(config: ServerConfig, engine: EngineClient) -> FastAPI:
    m = metrics_module.metrics()
    encoder = ThreadPoolExecutor(max_workers=2, thread_name_prefix="encode")
    app = FastAPI(title="diffserve", version="0.1.0",
                  description="OpenAI-style image generation with dynamic batching.")

    if config.api_key:
        app.add_middleware(BearerAuth, key=config.api_key)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return error_response(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return error_response(not_found(request.url.path))
        if exc.status_code == 405:
            return error_response(method_not_allowed(request.method, request.url.path))
        return error_response(APIError(str(exc.detail), status=exc.status_code))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return error_response(internal_error())

    @app.post("/v1/images/generations", openapi_extra=_json_body(ImageGenerationRequest))
    async def generate_images(http_request: Request):
        arrival = time.time()
        start = time.perf_counter()
        outcome = "cancelled"
        try:
            body = await parse_body(http_request, ImageGenerationRequest, config.max_body_bytes)
            info = engine.model_info
            request = to_engine_request(body, f"img-{uuid.uuid4().hex}", arrival, info, config)
            if engine.draining:
                raise unavailable("The server is shutting down.", "shutting_down")
            if not engine.engine_ready:
                raise unavailable("The model is not ready (the executor is starting or "
                                  "restarting); retry shortly.", "engine_not_ready")
            answer = await until_disconnected(http_request, engine.generate(request))
            if answer is None:
                return Response(status_code=499)  # nobody is listening; the work was dropped
            done, frames = answer
            encoded = await encode_images(encoder, frames, done.width, done.height,
                                          body.output_format, body.output_compression)
            outcome = "success"
            return OrjsonResponse({
                "created": int(arrival),
                "data": [{"b64_json": b64, "seed": seed} for b64, seed in zip(encoded, done.seeds)],
                "output_format": body.output_format,
                "size": f"{done.width}x{done.height}",
            })
        except APIError as error:
            outcome = ("rejected" if error.status == 429 else
                       "invalid" if error.status < 500 else "failed")
            raise
        except Exception:
            outcome = "failed"
            raise
        finally:
            m.requests_total.labels(status=outcome).inc()
            m.request_latency_seconds.observe(time.perf_counter() - start)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models():
        return ModelList(data=[ModelCard(id=engine.model_info.name, created=int(app_started))])

    @app.get("/health")
    async def health():
        if engine.engine_ready and not engine.stopped_reason:
            return {"status": "ok", "model": engine.model_info.name}
        raise unavailable(engine.stopped_reason or "The model is not ready.", "not_ready")

    @app.get("/metrics")
    async def prometheus_metrics():
        body, content_type = metrics_module.render()
        return Response(body, media_type=content_type)

    app_started = time.time()
    return app
