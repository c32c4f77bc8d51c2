"""BASELINE ONLY - not part of diffserve: the server people commonly write around a diffusers
pipeline (after the diffusers example server), for comparison: one pipeline call per request in a
thread pool, a fresh scheduler per request, tokenizers shared (docs/benchmark-tools.md). The
weights are in the dtype diffserve picks for the model (on a GPU its family's published one).

    python benchmarks/naive_server.py --model tiny-sd --port 8001
"""

from __future__ import annotations

import asyncio
import sys

import numpy as np
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from kit import cli
from diffserve.config.flags import DEFAULT_MODEL
from diffserve.executor.families.known import published_dtype
from diffserve.executor.model.dtypes import resolve_dtype
from diffserve.executor.model.loading import quiet_libraries
from diffserve.executor.pipeline import pipeline_class_of
from diffserve.frontend.encode import encode_image
from diffserve.builders import random as random_weights
from diffserve.builders.registry import resolve_model, serving_defaults


class Body(BaseModel):
    prompt: str = Field(min_length=1)
    n: int = Field(1, ge=1, le=10)
    size: str | None = None
    seed: int = Field(0, ge=0)
    num_inference_steps: int | None = Field(None, ge=1, le=200)
    guidance_scale: float | None = Field(None, ge=0)


def create_app(model: str) -> FastAPI:
    import torch
    from diffusers import DiffusionPipeline

    state: dict = {}

    async def lifespan(app: FastAPI):  # /health answers once this has loaded the model
        quiet_libraries()
        path = resolve_model(model)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = getattr(torch, resolve_dtype("auto", device, published_dtype(pipeline_class_of(path))))
        # A random-weight architecture (random:NAME) has no weights on disk: its modules are built.
        built = random_weights.build(path, device, dtype) if random_weights.marker(path) else {}
        state.update(pipe=DiffusionPipeline.from_pretrained(path, dtype=dtype, **built).to(device),
                     defaults=serving_defaults(path))
        yield

    app = FastAPI(title="naive baseline server (not diffserve)", lifespan=lifespan)

    def generate(body: Body, width: int, height: int) -> list[str]:
        base, d = state["pipe"], state["defaults"]
        # A scheduler of its own per request; torch_dtype, or from_pipe casts the model to float32.
        pipe = type(base).from_pipe(base, scheduler=base.scheduler.from_config(base.scheduler.config),
                                    torch_dtype=base.dtype)
        pipe.set_progress_bar_config(disable=True)
        guidance = d.get("guidance_scale") if body.guidance_scale is None else body.guidance_scale
        kwargs = {**d.get("pipeline_kwargs", {}), **({} if guidance is None else {"guidance_scale": guidance})}
        images = pipe(prompt=[body.prompt] * body.n, height=height, width=width, output_type="np", **kwargs,
                      generator=[torch.Generator("cpu").manual_seed(body.seed + i) for i in range(body.n)],
                      num_inference_steps=body.num_inference_steps or d.get("num_inference_steps", 30)).images
        pixels = (np.clip(np.asarray(images), 0, 1) * 255).round().astype(np.uint8)
        return [encode_image(image.tobytes(), width, height, "png") for image in pixels]  # as diffserve encodes

    @app.post("/v1/images/generations")
    async def generations(body: Body):
        d = state["defaults"]
        width, height = int(d.get("width", 512)), int(d.get("height", 512))
        if body.size and body.size != "auto":
            width, height = (int(v) for v in body.size.lower().split("x"))
        try:
            encoded = await asyncio.get_running_loop().run_in_executor(None, generate, body, width, height)
        except Exception as error:  # noqa: BLE001 - reported like an API error
            return JSONResponse({"error": {"message": f"{type(error).__name__}: {error}"}}, status_code=500)
        return {"data": [{"b64_json": b64, "seed": body.seed + i} for i, b64 in enumerate(encoded)]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "server": "naive-baseline"}

    return app


def main(argv: list[str] | None = None) -> int:
    p = cli.parser("BASELINE ONLY: a naive diffusers server.", model=DEFAULT_MODEL)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    args = p.parse_args(argv)
    uvicorn.run(create_app(args.model), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
