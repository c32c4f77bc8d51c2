"""The HTTP API: OpenAI-style images endpoints (generations and edits, plain or streamed), models,
health, metrics and the playground page.

Every error leaves through :func:`error_response`, the one place where errors become HTTP.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from importlib import resources

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from diffserve import metrics as metrics_module
from diffserve.config import ServerConfig
from diffserve.errors import (
    APIError,
    internal_error,
    invalid_request,
    method_not_allowed,
    not_found,
    unauthorized,
    unavailable,
)
from diffserve.frontend import streaming
from diffserve.frontend.encode import encode_images
from diffserve.frontend.engine_client import Done, EngineClient
from diffserve.frontend.schemas import (
    ImageEditForm,
    ImageGenerationRequest,
    ImageOptions,
    ImagesResponse,
    ModelCard,
    ModelList,
)
from diffserve.frontend.uploads import decode_inputs, parse_form, read_limited
from diffserve.frontend.validation import to_engine_request
from diffserve.protocol import EDIT, INPAINT, ImageRequest


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


def _form_body(model: type[BaseModel]) -> dict:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    schema["properties"] = {"image": {"type": "string", "format": "binary"},
                            "mask": {"type": "string", "format": "binary"}, **schema["properties"]}
    schema["required"] = ["image", *schema.get("required", [])]
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": schema}}}}


def _validate(model: type[BaseModel], data) -> BaseModel:
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise validation_error(error.errors()) from None


async def parse_body(request: Request, model: type[BaseModel], limit: int) -> BaseModel:
    """Parse the body as JSON whatever its content type (``curl -d`` sends form encoding)."""
    raw = await read_limited(request.stream(), limit, request.headers.get("content-length"))
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise validation_error([{"type": "json_invalid"}]) from None
    return _validate(model, data)


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


async def until_disconnected(request: Request, work):
    """Await ``work``, unless the client disconnects first: then cancel it and return None.
    If the caller itself is cancelled, ``work`` is cancelled with it.

    After the body is read, the ASGI ``receive`` only returns on disconnect, so waiting on it is
    an event, not a poll."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # cancelled ourselves: so is the work, without waiting for it
        task.cancel()
        raise
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


def _outcome(error: APIError) -> str:
    return "rejected" if error.status == 429 else "invalid" if error.status < 500 else "failed"


def create_app(config: ServerConfig, engine: EngineClient) -> FastAPI:
    m = metrics_module.metrics()
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="encode")
    playground = resources.files("diffserve.frontend").joinpath("static/index.html").read_text()
    app = FastAPI(title="diffserve", version="0.2.0",
                  description="OpenAI-style image generation and editing with dynamic batching.")

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

    def check_serving() -> None:
        if engine.draining:
            raise unavailable("The server is shutting down.", "shutting_down")
        if not engine.ready:
            raise unavailable("The model is not ready (no executor is serving: starting or "
                              "restarting); retry shortly.", "engine_not_ready")

    async def answer(http_request: Request, request: ImageRequest, frames: list, body: ImageOptions,
                     prefix: str, arrival: float, start: float):
        """Run an accepted request and answer it, as one JSON body or as a stream."""
        info = engine.model_info
        cells = (request.width // info.spatial_stride) * (request.height // info.spatial_stride)
        image_tokens = cells if frames else 0
        common = {"created_at": int(arrival), "size": f"{request.width}x{request.height}",
                  "quality": body.quality, "background": "opaque",
                  "output_format": body.output_format}

        def usage(text_tokens: int, images: int) -> dict:
            inputs = text_tokens + image_tokens
            return {"input_tokens": inputs, "output_tokens": images * cells,
                    "total_tokens": inputs + images * cells,
                    "input_tokens_details": {"image_tokens": image_tokens, "text_tokens": text_tokens}}

        def encode(frames_: list):
            return encode_images(pool, frames_, request.width, request.height, body.output_format,
                                 body.output_compression)

        if not body.stream:
            done = await until_disconnected(http_request, engine.generate(request, frames))
            if done is None:
                return None  # nobody is listening; the work was dropped
            encoded = await encode(done.frames)
            return OrjsonResponse({
                "created": int(arrival),
                "data": [{"b64_json": b64, "seed": seed} for b64, seed in zip(encoded, done.done.seeds)],
                "output_format": body.output_format, "size": common["size"],
                "quality": body.quality, "background": "opaque",
                "usage": usage(done.done.prompt_tokens, request.n),
            })

        submission = await engine.submit(request, frames)
        # The first event decides the status: a request that fails before anything was
        # streamed gets an ordinary error response.
        try:
            first = await until_disconnected(http_request, submission.next())
        except BaseException:
            submission.close()
            raise
        if first is None:
            submission.close()
            return None

        async def stream():
            outcome = "cancelled"
            try:
                event = first
                while True:
                    if isinstance(event, Done):
                        encoded = await encode(event.frames)
                        for i, (b64, seed) in enumerate(zip(encoded, event.done.seeds)):
                            yield streaming.completed(prefix, common, b64,
                                                      usage(event.done.prompt_tokens, 1), i,
                                                      request.n, seed)
                        outcome = "success"
                        return
                    (b64,) = await encode([event.frame])
                    yield streaming.partial_image(prefix, common, b64, event.partial.partial_index,
                                                  event.partial.index, request.n)
                    # Watch the client while waiting: the server may notice a departure only
                    # when it next writes, which can be a whole image later.
                    event = await until_disconnected(http_request, submission.next())
                    if event is None:
                        return
            except APIError as error:
                outcome = _outcome(error)
                yield streaming.error(error.body())
            finally:
                submission.close()  # the client left: the engine drops the work
                m.requests_total.labels(status=outcome).inc()
                m.request_latency_seconds.observe(time.perf_counter() - start)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"}, background=None)

    async def serve_images(http_request: Request, prepare, prefix: str):
        """Validate, run and answer; count the outcome once (streams count their own)."""
        arrival, start = time.time(), time.perf_counter()
        outcome, streamed = "cancelled", False
        try:
            request, frames, body = await prepare()
            check_serving()
            response = await answer(http_request, request, frames, body, prefix, arrival, start)
            if response is None:
                return Response(status_code=499)  # the client left; its work was dropped
            streamed = isinstance(response, StreamingResponse)
            outcome = "success"
            return response
        except APIError as error:
            outcome = _outcome(error)
            raise
        except Exception:
            outcome = "failed"
            raise
        finally:
            if not streamed:
                m.requests_total.labels(status=outcome).inc()
                m.request_latency_seconds.observe(time.perf_counter() - start)

    @app.post("/v1/images/generations", openapi_extra=_json_body(ImageGenerationRequest),
              responses={200: {"model": ImagesResponse}})
    async def generate_images(http_request: Request):
        async def prepare():
            body = await parse_body(http_request, ImageGenerationRequest, config.max_body_bytes)
            request = to_engine_request(body, f"img-{uuid.uuid4().hex}", engine.model_info, config)
            return request, [], body

        return await serve_images(http_request, prepare, streaming.GENERATION)

    @app.post("/v1/images/edits", openapi_extra=_form_body(ImageEditForm),
              responses={200: {"model": ImagesResponse}})
    async def edit_images(http_request: Request):
        async def prepare():
            raw = await read_limited(http_request.stream(), config.max_upload_bytes,
                                     http_request.headers.get("content-length"))
            form = await parse_form(http_request.headers, raw, config.max_upload_bytes)
            body = _validate(ImageEditForm, form.fields)
            task = INPAINT if form.mask is not None else EDIT
            request = to_engine_request(body, f"edit-{uuid.uuid4().hex}", engine.model_info,
                                        config, task)
            frames = await asyncio.get_running_loop().run_in_executor(
                pool, decode_inputs, form, request.width, request.height, config.max_input_pixels)
            return request, frames, body

        return await serve_images(http_request, prepare, streaming.EDIT)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models():
        info = engine.model_info
        return ModelList(data=[ModelCard(
            id=info.name, created=int(app_started), pipeline=info.pipeline_class,
            batching_mode=info.batching_mode, tasks=info.tasks,
            partial_images=info.partial_images)])

    @app.get("/health")
    async def health():
        info = engine.model_info
        body = {"status": "ok" if engine.ready else "unavailable", "model": info.name,
                "batching_mode": info.batching_mode,
                "executors": [dataclasses.asdict(e) for e in engine.status.executors]}
        if engine.stopped_reason:
            body["reason"] = engine.stopped_reason
        return JSONResponse(body, status_code=200 if engine.ready else 503)

    @app.get("/metrics")
    async def prometheus_metrics():
        body, content_type = metrics_module.render()
        return Response(body, media_type=content_type)

    @app.get("/", include_in_schema=False)
    async def page():
        return HTMLResponse(playground)

    app_started = time.time()
    return app
