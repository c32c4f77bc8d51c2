"""The HTTP API: OpenAI-style images endpoints, models, health and metrics.

Every error leaves through :func:`error_response`, the one place where errors become HTTP.
"""

from __future__ import annotations

import asyncio
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
    internal_error,
    invalid_request,
    method_not_allowed,
    not_found,
    unavailable,
)
from diffserve.frontend.encode import encode_image
from diffserve.frontend.engine_client import EngineClient
from diffserve.frontend.schemas import ImageGenerationRequest, ModelCard, ModelList
from diffserve.frontend.validation import to_engine_request


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


async def parse_body(request: Request, model: type[BaseModel]) -> BaseModel:
    """Parse the body as JSON whatever its content type (``curl -d`` sends form encoding)."""
    raw = await request.body()
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise validation_error([{"type": "json_invalid"}]) from None
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise validation_error(error.errors()) from None


def create_app(config: ServerConfig, engine: EngineClient) -> FastAPI:
    m = metrics_module.metrics()
    encoder = ThreadPoolExecutor(max_workers=2, thread_name_prefix="encode")
    app = FastAPI(title="diffserve", version="0.1.0",
                  description="OpenAI-style image generation with dynamic batching.")

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
            body = await parse_body(http_request, ImageGenerationRequest)
            info = engine.model_info
            request = to_engine_request(body, f"img-{uuid.uuid4().hex}", arrival, info, config)
            if not engine.engine_ready:
                raise unavailable("The model is not ready (the executor is starting or "
                                  "restarting); retry shortly.", "engine_not_ready")
            done, frames = await engine.generate(request)
            loop = asyncio.get_running_loop()
            encoded = await asyncio.gather(*(
                loop.run_in_executor(encoder, encode_image, frame.buffer if hasattr(frame, "buffer")
                                     else frame, done.width, done.height, body.output_format,
                                     body.output_compression)
                for frame in frames))
            outcome = "success"
            return JSONResponse({
                "created": int(arrival),
                "data": [{"b64_json": b64, "seed": seed} for b64, seed in zip(encoded, done.seeds)],
                "output_format": body.output_format,
                "size": f"{done.width}x{done.height}",
            })
        except APIError as error:
            outcome = "invalid" if error.status < 500 else "failed"
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
