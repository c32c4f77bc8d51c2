"""The runtime LoRA routes, present only with ``--enable-lora-runtime-updates`` (404 otherwise):
load or replace an adapter, and unload one. Which paths a body may name is
:mod:`diffserve.frontend.adapter_rules`'s rule."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from diffserve.frontend import adapter_rules as rules
from diffserve.frontend.bodies import json_body_schema, parse_json
from diffserve.frontend.schemas import LoadLoraAdapter, UnloadLoraAdapter
from diffserve.frontend.serving import Serving
from diffserve.wire.protocol import LOAD, UNLOAD


def adapter_routes(serving: Serving) -> APIRouter:
    router = APIRouter()
    config, scheduler = serving.config, serving.scheduler

    async def update(op: str, name: str, path: str = "") -> JSONResponse:
        served = scheduler.model_info.name
        rules.check_name(name, served)
        result = await scheduler.adapter_command(op, name, path)
        rules.raise_for(result, name, served, scheduler.adapters)
        return JSONResponse({"object": "lora_adapter", "name": name,
                             "status": "loaded" if op == LOAD else "unloaded"})

    @router.post("/v1/load_lora_adapter", openapi_extra=json_body_schema(LoadLoraAdapter))
    async def load_lora_adapter(http_request: Request):
        serving.check_serving()
        body = await parse_json(http_request, LoadLoraAdapter, config.max_body_bytes,
                                "--max-body-bytes")
        path = rules.path_inside(body.lora_path, config.lora_dir)
        return await update(LOAD, body.lora_name, path)

    @router.post("/v1/unload_lora_adapter", openapi_extra=json_body_schema(UnloadLoraAdapter))
    async def unload_lora_adapter(http_request: Request):
        serving.check_serving()
        body = await parse_json(http_request, UnloadLoraAdapter, config.max_body_bytes,
                                "--max-body-bytes")
        return await update(UNLOAD, body.lora_name)

    return router
