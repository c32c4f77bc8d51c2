"""What the server says of itself: the models it serves, its health, its metrics, and the
playground page."""

from __future__ import annotations

import dataclasses
import time
from importlib import resources
from typing import Callable

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, JSONResponse, Response

from diffserve.frontend.scheduler_client import SchedulerClient
from diffserve.frontend.schemas import ModelCard, ModelList


SEVERAL_MODELS_FIELDS = ("location", "size_bytes", "loaded_at", "swapped_at", "last_swap_s", "error")


def info_routes(scheduler: SchedulerClient, render_metrics: Callable[[], tuple[bytes, str]]) -> APIRouter:
    router = APIRouter()
    started = time.time()
    playground = resources.files("diffserve.frontend").joinpath("static/index.html").read_text()

    @router.get("/v1/models", response_model=ModelList)
    async def list_models():
        """Each model (one, or the several a server holds), then every LoRA adapter as a model
        of its own (its ``parent`` the base), so that the unmodified SDK can pick one by name."""
        cards = []
        for name, info, more in scheduler.model_states():
            if info is None:  # it could not load: listed with why
                cards.append(ModelCard(id=name, created=int(started), pipeline="",
                                       batching_mode="", tasks=[], partial_images=False, **more))
                continue
            card = dict(created=int(started), pipeline=info.pipeline_class, dtype=info.dtype,
                        batching_mode=info.batching_mode, tasks=info.tasks,
                        task_modes=info.task_modes, mixed_sizes=info.mixed_sizes,
                        unavailable_tasks=info.unavailable_tasks,
                        partial_images=info.partial_images, max_edit_images=info.max_edit_images,
                        schedulers=info.schedulers, num_frames=info.num_frames,
                        frame_stride=info.frame_stride, fps=info.fps,
                        audio_sample_rate=info.audio_sample_rate, parallel=info.parallel,
                        components=[dataclasses.asdict(c) for c in info.components],
                        weight_version=scheduler.status.weight_version,
                        random_weights=info.random_weights,
                        controls=[dataclasses.asdict(m) for m in info.control_models],
                        max_controls=info.max_controls if info.controls_supported else 0,
                        speed=info.speed)
            cards.append(ModelCard(id=name, **card, **more))
            if name == scheduler.model_info.name:  # adapters bind to the default model
                cards += [ModelCard(id=adapter, parent=name, **card)
                          for adapter in scheduler.adapters]
        body = ModelList(data=cards).model_dump(mode="json")
        for card in body["data"]:  # one model's cards read as they always have
            for key in SEVERAL_MODELS_FIELDS:
                if card[key] is None:
                    del card[key]
        return JSONResponse(body)

    @router.get("/health")
    async def health():
        info = scheduler.model_info
        body = {"status": "ok" if scheduler.ready else "unavailable", "model": info.name,
                "batching_mode": info.batching_mode,
                "executors": [dataclasses.asdict(e) for e in scheduler.status.executors]}
        several = getattr(scheduler, "engines_by_name", None)  # a server of several models
        if several:
            body["models"] = {name: {"location": more.get("location"), "executors": [
                dataclasses.asdict(e) for e in (several[name].status.executors
                                                if name in several else [])]}
                for name, _, more in scheduler.model_states()}
        if scheduler.stopped_reason:
            body["reason"] = scheduler.stopped_reason
        return JSONResponse(body, status_code=200 if scheduler.ready else 503)

    @router.get("/metrics")
    async def prometheus_metrics():
        body, content_type = render_metrics()
        return Response(body, media_type=content_type)

    @router.get("/", include_in_schema=False)
    async def page():
        return HTMLResponse(playground)

    return router
