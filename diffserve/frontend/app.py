"""The HTTP routes: OpenAI-style images endpoints (generations and edits, plain or streamed),
models, health, metrics and the playground page.

Reading bodies is :mod:`~diffserve.frontend.bodies`, answering an accepted request is
:mod:`~diffserve.frontend.responses`; every error leaves through
:func:`diffserve.errors.error_response`, the one place where errors become HTTP.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from typing import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from diffserve import metrics
from diffserve.config import ServerConfig
from diffserve.errors import (
    APIError,
    error_response,
    internal_error,
    invalid_request,
    method_not_allowed,
    not_found,
    unavailable,
)
from diffserve.frontend import adapters as adapter_rules
from diffserve.frontend import streaming
from diffserve.frontend.auth import BearerAuth
from diffserve.frontend.bodies import (
    form_body_schema,
    json_body_schema,
    parse_json,
    until_disconnected,
    validate,
    validation_error,
)
from diffserve.frontend.engine_client import EngineClient
from diffserve.frontend.responses import ImageAnswer
from diffserve.frontend.schemas import (
    ImageEditForm,
    ImageGenerationRequest,
    ImageOptions,
    ImagesResponse,
    LoadLoraAdapter,
    ModelCard,
    RolloutRequest,
    ModelList,
    UnloadLoraAdapter,
)
from diffserve.frontend.uploads import decode_inputs, parse_form, read_limited
from diffserve.frontend.validation import to_engine_request
from diffserve.protocol import LOAD, UNLOAD, ImageRequest
from diffserve.rollouts import LATENTS_LAYOUT, safetensors_body
from diffserve.tasks import GENERATE, IMAGE_TO_IMAGE, INPAINT, ROLLOUT

# What a route hands to :func:`serve_images`: the request for the engine, its input frames and
# the body it came from.
Accepted = tuple[ImageRequest, list, ImageOptions]


def rollout_fields(request: ImageRequest) -> dict:
    """A rollout's fields as its answer's metadata records them."""
    return {"prompt": request.prompt, "negative_prompt": request.negative_prompt,
            "n": request.n, "seed": request.seed, "width": request.width, "height": request.height,
            "num_inference_steps": request.num_inference_steps,
            "guidance_scale": request.guidance_scale, "noise_level": request.noise_level,
            "loras": [list(pair) for pair in request.loras], "return": list(request.returns)}


def create_app(config: ServerConfig, engine: EngineClient,
               render_metrics: Callable[[], tuple[bytes, str]]) -> FastAPI:
    counts = metrics.frontend()
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="encode")
    playground = resources.files("diffserve.frontend").joinpath("static/index.html").read_text()
    app = FastAPI(title="diffserve", version="0.3.0",
                  description="OpenAI-style image generation and editing with dynamic batching.")
    started = time.time()

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

    async def serve_images(http_request: Request, accept: Callable[[], Awaitable[Accepted]],
                           events: str, respond=None) -> Response:
        """Check that the server serves, read and validate the request (``accept``), run it
        and answer (as JSON or a stream; ``respond(request, done)`` makes any other answer).
        Its outcome is counted once, when the answer is complete (a stream's at its end)."""
        arrival, start = time.time(), time.perf_counter()

        def finished(outcome: str) -> None:
            counts.finished(outcome, time.perf_counter() - start)

        outcome, streamed = "cancelled", False
        try:
            check_serving()
            request, frames, body = await accept()
            counts.adapters_used(name for name, _ in request.loras)
            answer = ImageAnswer(request, body, events, arrival, engine.model_info.spatial_stride, pool)
            if body.stream:
                response = await stream(http_request, answer, request, frames, finished)
                streamed = response is not None
            else:
                done = await until_disconnected(http_request, engine.generate(request, frames))
                response = (None if done is None else respond(request, done) if respond
                            else await answer.json(done))
            if response is None:
                return Response(status_code=499)  # the client left; its work was dropped
            outcome = "success"
            return response
        except APIError as error:
            outcome = error.outcome
            raise
        except Exception:
            outcome = "failed"
            raise
        finally:
            if not streamed:
                finished(outcome)

    async def stream(http_request: Request, answer: ImageAnswer, request: ImageRequest,
                     frames: list, finished: Callable[[str], None]):
        """A streamed answer, or None if the client left before the first event. The first
        event decides the status: a request that fails before anything was streamed gets an
        ordinary error response."""
        submission = await engine.submit(request, frames)
        try:
            first = await until_disconnected(http_request, submission.next())
        except BaseException:
            submission.close()
            raise
        if first is None:
            submission.close()
            return None
        # Watch the client while waiting: the server may notice a departure only when it next
        # writes, which can be a whole image later.
        return answer.stream(first, submission,
                             lambda: until_disconnected(http_request, submission.next()), finished)

    @app.post("/v1/images/generations", openapi_extra=json_body_schema(ImageGenerationRequest),
              responses={200: {"model": ImagesResponse}})
    async def generate_images(http_request: Request):
        async def accept() -> Accepted:
            body = await parse_json(http_request, ImageGenerationRequest, config.max_body_bytes,
                                    "--max-body-bytes")
            request = to_engine_request(body, f"img-{uuid.uuid4().hex}", engine.model_info,
                                        config, GENERATE, engine.adapters)
            return request, [], body

        return await serve_images(http_request, accept, streaming.GENERATIONS)

    @app.post("/v1/images/edits", openapi_extra=form_body_schema(ImageEditForm),
              responses={200: {"model": ImagesResponse}})
    async def edit_images(http_request: Request):
        async def accept() -> Accepted:
            raw = await read_limited(http_request.stream(), config.max_upload_bytes,
                                     http_request.headers.get("content-length"),
                                     "--max-upload-bytes")
            form = await parse_form(http_request.headers, raw, config.max_upload_bytes)
            body = validate(ImageEditForm, form.fields)
            task = INPAINT if form.mask is not None else IMAGE_TO_IMAGE
            request = to_engine_request(body, f"edit-{uuid.uuid4().hex}", engine.model_info,
                                        config, task, engine.adapters)
            frames = await asyncio.get_running_loop().run_in_executor(
                pool, decode_inputs, form, request.width, request.height, config.max_input_pixels)
            return request, frames, body

        return await serve_images(http_request, accept, streaming.EDITS)

    @app.post("/v1/rollouts", openapi_extra=json_body_schema(RolloutRequest),
              response_class=Response, responses={200: {"content": {
                  "application/octet-stream": {}}, "description": "A safetensors file."}})
    async def rollouts(http_request: Request):
        async def accept() -> Accepted:
            body = await parse_json(http_request, RolloutRequest, config.max_body_bytes,
                                    "--max-body-bytes")
            if body.stream or body.response_format != "b64_json":
                raise invalid_request("a rollout is answered with one safetensors body: no "
                                      "stream, no url", "stream" if body.stream else
                                      "response_format", "unsupported_value")
            request = to_engine_request(body, f"roll-{uuid.uuid4().hex}", engine.model_info,
                                        config, ROLLOUT, engine.adapters)
            return request, [], body

        def respond(request: ImageRequest, done) -> Response:
            metadata = {"request": rollout_fields(request), "seeds": done.done.seeds,
                        "model": engine.model_info.name, "latents_layout": LATENTS_LAYOUT}
            return Response(safetensors_body(done.tensors, metadata),
                            media_type="application/octet-stream")

        return await serve_images(http_request, accept, streaming.GENERATIONS, respond)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models():
        """The base model, then every LoRA adapter as a model of its own (its ``parent`` the
        base), so that the unmodified SDK can pick one by name."""
        info = engine.model_info
        card = dict(created=int(started), pipeline=info.pipeline_class,
                    batching_mode=info.batching_mode, tasks=info.tasks,
                    partial_images=info.partial_images)
        return ModelList(data=[ModelCard(id=info.name, **card),
                               *(ModelCard(id=name, parent=info.name, **card)
                                 for name in engine.adapters)])

    if config.enable_lora_runtime_updates:
        async def update_adapter(op: str, name: str, path: str = "") -> JSONResponse:
            served = engine.model_info.name
            adapter_rules.check_name(name, served)
            result = await engine.adapter_command(op, name, path)
            adapter_rules.raise_for(result, name, served, engine.adapters)
            return JSONResponse({"object": "lora_adapter", "name": name,
                                 "status": "loaded" if op == LOAD else "unloaded"})

        @app.post("/v1/load_lora_adapter", openapi_extra=json_body_schema(LoadLoraAdapter))
        async def load_lora_adapter(http_request: Request):
            check_serving()
            body = await parse_json(http_request, LoadLoraAdapter, config.max_body_bytes,
                                    "--max-body-bytes")
            path = adapter_rules.path_inside(body.lora_path, config.lora_dir)
            return await update_adapter(LOAD, body.lora_name, path)

        @app.post("/v1/unload_lora_adapter", openapi_extra=json_body_schema(UnloadLoraAdapter))
        async def unload_lora_adapter(http_request: Request):
            check_serving()
            body = await parse_json(http_request, UnloadLoraAdapter, config.max_body_bytes,
                                    "--max-body-bytes")
            return await update_adapter(UNLOAD, body.lora_name)

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
        body, content_type = render_metrics()
        return Response(body, media_type=content_type)

    @app.get("/", include_in_schema=False)
    async def page():
        return HTMLResponse(playground)

    return app
