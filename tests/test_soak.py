"""Soak: a real `diffserve serve` under many concurrent requests. None may be lost or fail, every
image must equal its own request's image made alone by the plain pipeline (tests/reference.py),
and the server must have batched (fewer dispatches than requests) and exit cleanly. The short run
is in the default suite; the 2,000-request runs are marked slow (`python -m pytest -m slow`)."""

from __future__ import annotations

import asyncio
import base64
import functools
import io

import httpx
import numpy as np
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from diffserve.executor.model.task_pipelines import task_pipelines
from diffserve.executor.model.loading import load_model
from helpers import make_request
from diffserve.executor.checks.reference import max_diff, solo
from server import Server

MODEL = "tiny-sd"
SUBJECTS = ["a cat", "a boat at sea", "a red circle", "noise"]


def make_plan(count: int, distinct: int) -> list[dict]:
    """``count`` bodies reusing ``distinct`` (prompt, seed, steps) jobs in turn; every third asks
    for two images, and a third of the jobs run 2 steps instead of 4 (step mode mixes them)."""
    jobs = [(f"soak {k}: {SUBJECTS[k % 4]}", 7919 * k, 2 if k % 3 == 1 else 4) for k in range(distinct)]
    return [{"prompt": prompt, "seed": seed, "num_inference_steps": steps, "n": 2 if i % 3 == 0 else 1,
             "size": "64x64", "guidance_scale": 5.0}
            for i, (prompt, seed, steps) in ((i, jobs[i % distinct]) for i in range(count))]


@functools.lru_cache(maxsize=1)  # both modes' soaks check the same plan
def references(count: int, distinct: int) -> dict[tuple[str, int, int], np.ndarray]:
    """(prompt, seed of the image, steps) -> the image, each from one plain pipeline call alone."""
    plan = make_plan(count, distinct)
    loaded = load_model(MODEL, torch_threads=1)
    edits = task_pipelines(loaded.pipe)
    wanted = {(b["prompt"], b["seed"], b["num_inference_steps"], i) for b in plan for i in range(b["n"])}
    out = {}
    for prompt, seed, steps, i in sorted(wanted):
        request = make_request(n=i + 1, prompt=prompt, seed=seed, steps=steps, model=MODEL)
        out[(prompt, seed + i, steps)] = solo(loaded, edits, request, start=i, stop=i + 1)[0]
    return out


async def send_all(url: str, plan: list[dict], concurrency: int) -> list[httpx.Response | Exception]:
    limit = asyncio.Semaphore(concurrency)
    pool = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=pool) as client:
        async def one(body: dict) -> httpx.Response | Exception:
            async with limit:
                try:
                    return await client.post("/v1/images/generations", json=body)
                except httpx.HTTPError as error:
                    return error

        return await asyncio.gather(*(one(body) for body in plan))


def metric(text: str, name: str) -> float:
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name)


def soak(server: Server, count: int, concurrency: int, distinct: int) -> dict:
    """``server``: launched (see SERVER), maybe not ready yet."""
    plan = make_plan(count, distinct)
    try:
        refs = references(count, distinct)  # while it loads
        server.start()
        responses = asyncio.run(send_all(server.url, plan, concurrency))
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
    finally:
        exit_code = server.stop()
    lost = [r for r in responses if not isinstance(r, httpx.Response)]
    assert not lost, f"{len(lost)} requests lost, e.g. {lost[0]!r}"
    failed = [r for r in responses if r.status_code != 200]
    assert not failed, f"{len(failed)} failed, e.g. {failed[0].status_code} {failed[0].text[:300]}"
    worst = images = 0
    for body, response in zip(plan, responses):
        data = response.json()["data"]
        assert [d["seed"] for d in data] == [body["seed"] + i for i in range(body["n"])]
        for d in data:
            pixels = np.asarray(Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))).convert("RGB"))
            diff = max_diff(pixels, refs[(body["prompt"], d["seed"], body["num_inference_steps"])])
            assert diff <= 2, (body, d["seed"], diff)
            worst, images = max(worst, diff), images + 1
    assert images == sum(b["n"] for b in plan)
    assert metric(metrics, "diffserve_requests_total") == count  # none counted twice, none invalid
    dispatches = metric(metrics, "diffserve_batch_size_count")
    assert 0 < dispatches < count, f"no batching: {dispatches:.0f} dispatches for {count} requests"
    assert exit_code == 0, server.log[-3000:]
    return {"images": images, "dispatches": dispatches, "worst_pixel_diff": worst}


SERVER = pytest.mark.server("--model", MODEL, "--batching-mode", "{mode}",
                            "--dynamic-batch-max-size", "8", "--dynamic-batch-delay-ms", "8",
                            "--torch-threads", "1", "--log-level", "warning", timeout_s=300)


@pytest.mark.parametrize("mode", ["step", "request"])
@SERVER
def test_short_soak(own_server, mode):
    soak(own_server, count=200, concurrency=32, distinct=24)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["step", "request"])
@SERVER
def test_full_soak(own_server, mode):
    soak(own_server, count=2000, concurrency=64, distinct=64)
