"""The routes that make images: generations, edits (multipart uploads) and rollouts (one
safetensors body). Each reads and validates its body, turns it into its typed spec
(:mod:`diffserve.frontend.spec`) and the engine's request, and decodes the request's input frames
in the order its manifest lists them; :class:`~diffserve.frontend.serving.Serving` does the
rest."""

from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Callable

import orjson

from fastapi import APIRouter, Request
from fastapi.responses import Response

from diffserve.errors import invalid_request
from diffserve.frontend import streaming
from diffserve.frontend.controls import control_frames
from diffserve.frontend.auth import PRIORITY
from diffserve.frontend.compat import check_served
from diffserve.frontend.bodies import (form_body_schema, json_body_schema, parse_json, validate,
                                      validation_error)
from diffserve.frontend.image_jobs.jobs import ImageJobs
from diffserve.frontend.image_jobs.routes import accepted_response, check_job_fields, prefers_async
from diffserve.frontend.image_jobs.store import ImageJob
from diffserve.frontend.image_urls import json_edit_inputs
from diffserve.frontend.schemas import (ImageEditForm, ImageEditJSON, ImageGenerationRequest,
                                        ImagesResponse, RolloutRequest)
from diffserve.frontend.serving import Accepted, Serving
from diffserve.frontend.spec import RequestSpec, edit_spec, generation_spec, rollout_spec
from diffserve.frontend.uploads import (EditForm, decode_inputs, image_size, parse_form,
                                        read_limited)
from diffserve.frontend.validation import fitted_size, to_engine_request
from diffserve.wire.request import CONTROLS, ImageRequest, in_manifest_order
from diffserve.wire.rollouts import LATENTS_LAYOUT, safetensors_body
from diffserve.wire.tasks import EDIT, GENERATE, IMAGE_TO_IMAGE, INPAINT, ROLLOUT, Task


def rollout_fields(request: ImageRequest) -> dict:
    """A rollout's fields as its answer's metadata records them."""
    return {"prompt": request.prompt, "negative_prompt": request.negative_prompt,
            "n": request.n, "seed": request.seed, "width": request.width, "height": request.height,
            "num_inference_steps": request.num_inference_steps,
            "guidance_scale": request.guidance_scale, "noise_level": request.noise_level,
            "loras": [list(pair) for pair in request.loras], "return": list(request.returns)}


def key_priority(http_request: Request) -> int | None:
    """The priority class of the API key the request came with (see frontend.auth)."""
    return getattr(http_request.state, PRIORITY, None)


def input_frames(request: ImageRequest, spec: RequestSpec, max_pixels: int,
                 uploads: dict[str, list] | None = None) -> list:
    """The frames to send with ``request``, in its manifest's order: the uploads (by role),
    and each control's own image."""
    controls = control_frames(spec.controls, request.width, request.height, max_pixels)
    return in_manifest_order(request.manifest, {**(uploads or {}), CONTROLS: controls})


def edit_task(info, form) -> Task:
    """What an edit of this model is: inpainting with a mask, or on a model that only inpaints
    (FLUX.1 Fill: the image's transparency is then its mask); else an instruction edit where the
    model conditions on reference images, image-to-image where it redraws by strength."""
    if form.mask is not None or tuple(info.tasks) == (INPAINT.name,):
        return INPAINT
    return EDIT if EDIT.name in info.tasks else IMAGE_TO_IMAGE


async def read_edit(http_request: Request, config) -> tuple[ImageEditForm, EditForm]:
    """An edit's body and its input files: a multipart form, or JSON naming them by URL."""
    limit = config.max_upload_bytes
    raw = await read_limited(http_request.stream(), limit,
                             http_request.headers.get("content-length"), "--max-upload-bytes")
    content_type = http_request.headers.get("content-type", "").lower()
    if content_type.startswith("application/json"):
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise validation_error([{"type": "json_invalid"}]) from None
        body = validate(ImageEditJSON, data)
        images, mask = await json_edit_inputs(body, config.allowed_image_hosts, limit)
        return body, EditForm({}, images, mask)
    form = await parse_form(http_request.headers, raw, limit)
    return validate(ImageEditForm, form.fields), form


def data_url(data: bytes) -> str:
    return "data:image;base64," + base64.b64encode(data).decode()


def stored_edit(body: ImageEditForm, form: EditForm) -> dict:
    """An edit as the JSON edit that runs it again (its inputs as data URLs)."""
    stored = body.model_dump(mode="json", exclude_unset=True, exclude={"images", "mask"})
    stored["images"] = [{"image_url": data_url(image)} for image in form.images]
    if form.mask is not None:
        stored["mask"] = {"image_url": data_url(form.mask)}
    return stored


def image_routes(serving: Serving, jobs: ImageJobs | None = None) -> tuple[APIRouter, Callable]:
    """The routes, and how a stored job's request is made again (for its resumption)."""
    router = APIRouter()
    config, scheduler = serving.config, serving.scheduler

    async def generation(body: ImageGenerationRequest, priority: int | None) -> Accepted:
        check_served(body)
        spec = generation_spec(body)
        info, adapters = scheduler.route(body.model)
        request = to_engine_request(spec, f"img-{uuid.uuid4().hex}", info,
                                    config, GENERATE, adapters, key_priority=priority)
        frames = await asyncio.get_running_loop().run_in_executor(
            serving.pool, input_frames, request, spec, config.max_input_pixels
        ) if request.manifest else []
        return request, frames, body

    async def edit(body: ImageEditForm, form: EditForm, priority: int | None) -> Accepted:
        check_served(body)
        spec = edit_spec(body)
        info, adapters = scheduler.route(body.model)
        task, size = edit_task(info, form), None
        if task.references:  # without a size, the first input's, fitted to the model
            size = fitted_size(*image_size(form.images[0], config.max_input_pixels), info,
                               config)
        elif len(form.images) > 1:
            raise invalid_request(f"{len(form.images)} input images; model {info.name!r} "
                                  "takes one per edit", "image", "invalid_value")
        request = to_engine_request(spec, f"edit-{uuid.uuid4().hex}", info, config, task,
                                    adapters, len(form.images), size, priority)
        frames = await asyncio.get_running_loop().run_in_executor(
            serving.pool, lambda: input_frames(
                request, spec, config.max_input_pixels,
                decode_inputs(form, task, request.width, request.height,
                              config.max_input_pixels)))
        return request, frames, body

    async def rebuild(job: ImageJob) -> Accepted:
        stored = job.body["request"]
        if job.route == "generations":
            return await generation(validate(ImageGenerationRequest, stored), job.key_priority)
        body = validate(ImageEditJSON, stored)
        images, mask = await json_edit_inputs(body, (), config.max_upload_bytes)
        return await edit(body, EditForm({}, images, mask), job.key_priority)

    async def as_job(http_request: Request, route: str, accept, stored, events: str):
        serving.check_serving()
        accepted = await accept()
        return accepted_response(jobs, http_request, route, stored(accepted), key_priority(
            http_request), accepted, events)

    @router.post("/v1/images/generations", openapi_extra=json_body_schema(ImageGenerationRequest),
                 responses={200: {"model": ImagesResponse}})
    async def generate_images(http_request: Request):
        asynchronous = jobs is not None and prefers_async(http_request)

        async def accept() -> Accepted:
            body = await parse_json(http_request, ImageGenerationRequest, config.max_body_bytes,
                                    "--max-body-bytes")
            check_job_fields(body, asynchronous, config)
            return await generation(body, key_priority(http_request))

        if asynchronous:
            return await as_job(http_request, "generations", accept, lambda accepted: accepted[
                2].model_dump(mode="json", exclude_unset=True), streaming.GENERATIONS)
        return await serving.serve(http_request, accept, streaming.GENERATIONS)

    @router.post("/v1/images/edits", openapi_extra=form_body_schema(ImageEditForm,
                                                                          ImageEditJSON),
                 responses={200: {"model": ImagesResponse}})
    async def edit_images(http_request: Request):
        asynchronous = jobs is not None and prefers_async(http_request)
        forms = []

        async def accept() -> Accepted:
            body, form = await read_edit(http_request, config)
            check_job_fields(body, asynchronous, config)
            forms.append(form)
            return await edit(body, form, key_priority(http_request))

        if asynchronous:
            return await as_job(http_request, "edits", accept, lambda accepted: stored_edit(
                accepted[2], forms[0]), streaming.EDITS)
        return await serving.serve(http_request, accept, streaming.EDITS)

    @router.post("/v1/rollouts", openapi_extra=json_body_schema(RolloutRequest),
                 response_class=Response, responses={200: {"content": {
                     "application/octet-stream": {}}, "description": "A safetensors file."}})
    async def rollouts(http_request: Request):
        async def accept() -> Accepted:
            body = await parse_json(http_request, RolloutRequest, config.max_body_bytes,
                                    "--max-body-bytes")
            check_job_fields(body, False, config)
            if body.stream or body.response_format != "b64_json":
                raise invalid_request("a rollout is answered with one safetensors body: no "
                                      "stream, no url", "stream" if body.stream else
                                      "response_format", "unsupported_value")
            spec = rollout_spec(body)
            info, adapters = scheduler.route(body.model)
            request = to_engine_request(spec, f"roll-{uuid.uuid4().hex}", info,
                                        config, ROLLOUT, adapters,
                                        key_priority=key_priority(http_request))
            frames = await asyncio.get_running_loop().run_in_executor(
                serving.pool, input_frames, request, spec, config.max_input_pixels
            ) if request.manifest else []
            return request, frames, body

        def respond(request: ImageRequest, done) -> Response:
            metadata = {"request": rollout_fields(request), "seeds": done.done.seeds,
                        "model": request.model, "latents_layout": LATENTS_LAYOUT,
                        "weight_version": done.done.weight_version}
            return Response(safetensors_body(done.tensors, metadata),
                            media_type="application/octet-stream")

        return await serving.serve(http_request, accept, streaming.GENERATIONS, respond)

    return router, rebuild
