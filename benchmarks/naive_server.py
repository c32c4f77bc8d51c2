"""BASELINE ONLY - not part of diffserve. A naive image server, for comparison.

This is the server people commonly write around a diffusers pipeline (it follows the pattern of
the diffusers example server): a FastAPI app that loads the pipeline once and, for every
request, runs one pipeline call in a thread pool (``run_in_executor``), with a fresh copy of the
scheduler per request because schedulers keep per-call state. There is no batching across
requests and no control over how many calls run at once; concurrent calls share the CPU or GPU
through the thread pool.

Like that example, it shares the tokenizers between threads. Fast tokenizers keep their padding
and truncation settings as state, so concurrent calls can race and a request fails now and then
(e.g. "Sizes of tensors must match ... Expected size 77 but got size 33"); that is part of what
this baseline represents. ``--copy-tokenizers`` gives each request its own tokenizers instead.

It speaks the same API shape as diffserve (``POST /v1/images/generations`` with prompt, n,
size, seed, num_inference_steps, guidance_scale, negative_prompt, output_format; ``GET
/health``) so that bench_serving.py and compare.py can measure both the same way. It has no
``/metrics``.

    python benchmarks/naive_server.py --model tiny-sd --port 8001
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import copy
import io
import os
import secrets
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
from fastapi import FastAPI  # noqa: E402
from fastapi.exceptions import RequestValidationError  # noqa: E402
from fastapi.responses import JSONResponse  # noqa: E402
from pydantic import BaseModel, ConfigDict, Field  # noqa: E402

from diffserve.config import DEFAULT_MODEL  # noqa: E402


class GenerationBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    prompt: str = Field(min_length=1)
    model: str | None = None
    n: int = Field(1, ge=1, le=10)
    size: str | None = None
    seed: int | None = Field(None, ge=0)
    num_inference_steps: int | None = Field(None, ge=1, le=200)
    guidance_scale: float | None = Field(None, ge=0)
    negative_prompt: str | None = None
    output_format: Literal["png", "jpeg", "webp"] = "png"


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error"
                                   if status < 500 else "server_error"}}, status_code=status)


def create_app(model: str, device: str = "auto", threads: int | None = None,
               copy_tokenizers: bool = False) -> FastAPI:
    import diffusers
    import torch
    import transformers
    from diffusers import DiffusionPipeline

    from diffserve.models.registry import resolve_model, serving_defaults

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    state: dict = {}
    # Like the diffusers example server: the event loop's thread pool runs the pipeline calls.
    # `threads` None keeps Python's default pool size (min(32, cpu_count + 4)).
    pool = ThreadPoolExecutor(max_workers=threads) if threads else None

    async def lifespan(app: FastAPI):
        path = resolve_model(model)
        pick = device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch.float16 if pick.startswith("cuda") else torch.float32
        pipe = DiffusionPipeline.from_pretrained(path, dtype=dtype).to(pick)
        pipe.set_progress_bar_config(disable=True)
        state.update(pipe=pipe, defaults=serving_defaults(path), device=pick)
        yield
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="naive baseline server (not diffserve)", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return _error(400, f"invalid {where or 'body'}: {first.get('msg', 'invalid request')}")

    def generate(body: GenerationBody, width: int, height: int, seed: int) -> list[str]:
        base = state["pipe"]
        defaults = state["defaults"]
        # One pipeline object per request sharing the weights, with its own scheduler: a
        # scheduler holds the timesteps of the call in progress, so sharing one between
        # threads would mix up concurrent calls.
        own = {"scheduler": base.scheduler.from_config(base.scheduler.config)}
        if copy_tokenizers:
            own.update({name: copy.deepcopy(component) for name, component in
                        base.components.items() if name.startswith("tokenizer") and component})
        pipe = type(base).from_pipe(base, **own)
        pipe.set_progress_bar_config(disable=True)
        kwargs = dict(defaults.get("pipeline_kwargs", {}))
        guidance = body.guidance_scale if body.guidance_scale is not None else defaults.get(
            "guidance_scale")
        if guidance is not None:
            kwargs["guidance_scale"] = guidance
        if body.negative_prompt:
            kwargs["negative_prompt"] = [body.negative_prompt] * body.n
        images = pipe(
            prompt=[body.prompt] * body.n,
            generator=[torch.Generator("cpu").manual_seed(seed + i) for i in range(body.n)],
            num_inference_steps=body.num_inference_steps or defaults.get("num_inference_steps", 30),
            height=height, width=width, output_type="np", **kwargs).images
        from PIL import Image

        encoded = []
        for array in np.asarray(images):
            pixels = (np.clip(array, 0.0, 1.0) * 255).round().astype(np.uint8)
            out = io.BytesIO()
            Image.fromarray(pixels).save(out, format=body.output_format.upper())
            encoded.append(base64.b64encode(out.getvalue()).decode("ascii"))
        return encoded

    @app.post("/v1/images/generations")
    async def generations(body: GenerationBody):
        if "pipe" not in state:
            return _error(503, "model not loaded")
        defaults = state["defaults"]
        width, height = int(defaults.get("width", 512)), int(defaults.get("height", 512))
        if body.size and body.size != "auto":
            try:
                width, height = (int(v) for v in body.size.lower().split("x"))
            except ValueError:
                return _error(400, f"size {body.size!r} is not WIDTHxHEIGHT")
            stride = int(defaults.get("spatial_stride", 8))
            if width % stride or height % stride or width <= 0 or height <= 0:
                return _error(400, f"width and height must be positive multiples of {stride}")
        seed = body.seed if body.seed is not None else secrets.randbelow(2**31)
        created = int(time.time())
        loop = asyncio.get_running_loop()
        try:
            encoded = await loop.run_in_executor(pool, generate, body, width, height, seed)
        except Exception as error:  # noqa: BLE001 - report it like an API error
            return _error(500, f"generation failed: {type(error).__name__}: {error}")
        return {"created": created, "size": f"{width}x{height}", "output_format": body.output_format,
                "data": [{"b64_json": b64, "seed": seed + i} for i, b64 in enumerate(encoded)]}

    @app.get("/health")
    async def health():
        if "pipe" not in state:
            return _error(503, "model not loaded")
        return {"status": "ok", "model": model, "server": "naive-baseline"}

    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="BASELINE ONLY: a naive diffusers server (one pipeline call per request, run "
                    "in a thread pool, no batching), for comparison with diffserve.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="Embedded model name, pipeline directory or hub id.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N.")
    parser.add_argument("--threads", type=int, default=None,
                        help="Thread pool size (default: Python's default pool).")
    parser.add_argument("--copy-tokenizers", action="store_true",
                        help="Give each request its own tokenizers (avoids the occasional failure "
                             "when concurrent calls race on shared fast tokenizers).")
    args = parser.parse_args(argv)

    import uvicorn

    uvicorn.run(create_app(args.model, args.device, args.threads, args.copy_tokenizers),
                host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
