"""The online-RL control routes, present only with ``--enable-weight-updates`` (404 otherwise):
new weights, sleeping and waking (docs/rl.md). A path must lie inside ``--weights-dir``; tensors
come as a file in shared memory (:mod:`diffserve.wire.shared_tensors`), which the server takes over."""

from __future__ import annotations

import time

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from diffserve.wire import shared_tensors
from diffserve.wire.weight_commands import PATH, SHARED, SLEEP, UPDATE, WAKE, WeightCommand, WeightResult, WeightSource
from diffserve.errors import APIError, invalid_request
from diffserve.frontend.adapter_rules import path_inside
from diffserve.frontend.bodies import json_body_schema, parse_json, validate, validation_error
from diffserve.frontend.uploads import read_limited
from diffserve.frontend.schemas import SleepBody, UpdateWeights
from diffserve.frontend.serving import Serving

PARAMS = {"invalid_weights": "path", "invalid_value": "weight_version"}


def weight_routes(serving: Serving) -> APIRouter:
    router = APIRouter()
    config, scheduler = serving.config, serving.scheduler

    def raise_for(result: WeightResult) -> None:
        if result.status != 200:
            kind = "invalid_request_error" if result.status < 500 else "server_error"
            raise APIError(result.error, PARAMS.get(result.code), result.code or None,
                           result.status, kind)

    def source_of(body: UpdateWeights) -> WeightSource:
        if (body.path is None) == (body.tensors is None):
            raise invalid_request("give the new weights as exactly one of path (a directory "
                                  "or file inside --weights-dir) and tensors (a file in shared "
                                  "memory)", "path", "invalid_value")
        if body.path is not None:
            return WeightSource(PATH, path_inside(body.path, config.weights_dir, "path",
                                                  "--weights-dir"))
        try:
            return WeightSource(SHARED, shared_tensors.take_over(body.tensors.shared_memory,
                                                                 scheduler.shared_dir))
        except shared_tensors.NotShared as error:
            raise invalid_request(str(error), "tensors", "invalid_value") from None

    @router.post("/v1/update_weights", openapi_extra=json_body_schema(UpdateWeights))
    async def update_weights(http_request: Request):
        serving.check_serving()
        body = await parse_json(http_request, UpdateWeights, config.max_body_bytes,
                                "--max-body-bytes")
        source = source_of(body)
        result = await scheduler.weights_command(WeightCommand(
            "", UPDATE, source, body.mode, body.weight_version or ""))
        raise_for(result)
        return JSONResponse({"weight_version": result.version, "applied_at": result.applied_at,
                             "is_sleeping": bool(result.sleeping)})

    @router.post("/v1/sleep", openapi_extra=json_body_schema(SleepBody))
    async def sleep(http_request: Request):
        serving.check_serving()
        raw = await read_limited(http_request.stream(), config.max_body_bytes,
                                 http_request.headers.get("content-length"), "--max-body-bytes")
        body = sleep_body(raw)
        result = await scheduler.weights_command(WeightCommand("", SLEEP, level=body.level))
        raise_for(result)
        return JSONResponse({"is_sleeping": True, "level": result.sleeping})

    @router.post("/v1/wake_up")
    async def wake_up():
        serving.check_serving()
        began = time.perf_counter()
        result = await scheduler.weights_command(WeightCommand("", WAKE))
        raise_for(result)
        return JSONResponse({"is_sleeping": False, "weight_version": result.version,
                             "seconds": round(time.perf_counter() - began, 3)})

    @router.get("/v1/is_sleeping")
    async def is_sleeping():
        level = scheduler.status.sleeping
        return JSONResponse({"is_sleeping": bool(level), "level": level})

    return router


def sleep_body(raw: bytes) -> SleepBody:
    """A sleep's body: none at all means the default level."""
    if not raw.strip():
        return SleepBody()
    try:
        return validate(SleepBody, orjson.loads(raw))
    except orjson.JSONDecodeError:
        raise validation_error([{"type": "json_invalid"}]) from None
