"""LoRA adapters through the real server (tiny-sd): --lora-modules, choosing adapters per request
(model=NAME with the official SDK, the loras field), step mode sharing forwards across adapters,
request mode grouping by stack, runtime loads and replaces under load, eviction, and the rules
around files and keys. Every image equals plain diffusers after load_lora_weights/set_adapters."""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import openai
import pytest
from diffusers import DiffusionPipeline

from diffserve.builders.registry import resolve_model
from helpers import make_request
from diffserve.executor.checks.reference import max_diff, solo, with_adapters
from server import Queue, assert_openai_error, decode, metric, spec, wait_for_metric
from diffserve.builders.random.loras import write_kohya, write_lora
from pace import scaled

GENERATE = "/v1/images/generations"
SPECS = {"A": dict(rank=4, seed=1), "B": dict(rank=16, seed=2),
         "C": dict(rank=4, seed=3, text_encoder=True), "D": dict(rank=4, seed=4)}
BODIES = [  # 8 requests over {none, A, B, A@0.5, A+B, C}
    {"prompt": "base"}, {"prompt": "a", "model": "A"}, {"prompt": "b", "loras": [{"name": "B"}]},
    {"prompt": "half a", "loras": [{"name": "A", "scale": 0.5}]},
    {"prompt": "a and b", "loras": [{"name": "A", "scale": 0.6}, {"name": "B", "scale": 0.8}]},
    {"prompt": "c", "loras": [{"name": "C"}]}, {"prompt": "c again", "model": "C"},
    {"prompt": "b via model, a stacked", "model": "B", "loras": [{"name": "A", "scale": -0.5}]},
]


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    for name, spec in SPECS.items():
        write_lora("tiny-sd", root / name, **spec)
    write_kohya(root / "A", root / "A.kohya.safetensors")
    return root


@pytest.fixture(scope="module")
def reference(lora_dir):
    pipe = DiffusionPipeline.from_pretrained(resolve_model("tiny-sd"))
    pipe.set_progress_bar_config(disable=True)
    for name in SPECS:
        pipe.load_lora_weights(str(lora_dir / name), adapter_name=name)
    return pipe


def stack_of(body: dict) -> list[tuple[str, float]]:
    stack = [(body["model"], 1.0)] if body.get("model") else []
    return stack + [(ref["name"], ref.get("scale", 1.0)) for ref in body.get("loras", [])]


def expected(reference, body: dict, seed: int, steps: int, **kw):
    r = make_request(prompt=body["prompt"], seed=seed, steps=steps, **kw)
    return solo(SimpleNamespace(pipe=with_adapters(reference, stack_of(body)), call_kwargs={}), {}, r)[0]


def modules(lora_dir, *names: str) -> list[str]:
    return ["--lora-modules", *(f"{n}={lora_dir / n}" for n in names)]


def post(server, body, timeout=120) -> httpx.Response:
    with server.client(timeout=timeout) as c:
        return c.post(GENERATE, json=body)


@pytest.fixture(scope="module")
def servers(lora_dir, tmp_path_factory):
    """Every server of this module, launched in the order the tests take them (see Queue): their
    adapters' files, and those the runtime checks look for, are written first."""
    outside = tmp_path_factory.mktemp("outside")
    shutil.copytree(lora_dir / "B", outside / "B")
    os.symlink(outside / "B", lora_dir / "link-out")
    (lora_dir / "file-link-out").mkdir()  # a directory inside whose weights file is a link out
    os.symlink(outside / "B" / "pytorch_lora_weights.safetensors",
               lora_dir / "file-link-out" / "pytorch_lora_weights.safetensors")
    misfit = tmp_path_factory.mktemp("misfit") / "sdxl"
    write_lora("tiny-sdxl", misfit, rank=4)
    served = {mode: spec(*modules(lora_dir, "A", "B", "C"), "--batching-mode", mode,
                         "--dynamic-batch-max-size", "8", "--dynamic-batch-delay-ms", "50",
                         "--max-inference-steps", "1000") for mode in ("step", "request")}
    queue = Queue({
        **served,
        # Runtime updates on, with an API key; the adapters' directory is --lora-dir.
        "runtime": spec(*modules(lora_dir, "A"), "--enable-lora-runtime-updates", "--lora-dir",
                        str(lora_dir), "--api-key", "k", "--max-inference-steps", "1000"),
        "off": spec(*modules(lora_dir, "A")),
        "max-loras": spec(*modules(lora_dir, "A", "B", "C"), "--max-loras", "2",
                          "--max-loras-per-request", "2", "--batching-mode", "step",
                          "--dynamic-batch-max-size", "4"),
        "kohya": spec("--lora-modules", f"K={lora_dir / 'A.kohya.safetensors'}"),
        "misfit": spec("--lora-modules", f"misfit={misfit}"),
    })
    queue.outside = outside
    yield queue
    queue.close()


@pytest.fixture(scope="module", params=["step", "request"])
def server(request, servers):
    with servers.take(request.param) as srv:
        srv.mode = request.param
        yield srv


def test_concurrent_requests_over_different_adapters_are_exact(server, reference):
    before = httpx.get(server.url + "/metrics").text
    steps = [6, 8, 6, 10, 8, 6, 12, 8]
    with ThreadPoolExecutor(8) as pool:
        first = [pool.submit(post, server, {**b, "seed": i, "num_inference_steps": steps[i]})
                 for i, b in enumerate(BODIES[:4])]
        if server.mode == "step":  # the rest join a running set at later steps
            wait_for_metric(server, "diffserve_num_requests_running", lambda v: v >= 1)
        rest = [pool.submit(post, server, {**b, "seed": 4 + i, "num_inference_steps": steps[4 + i]})
                for i, b in enumerate(BODIES[4:])]
        responses = [f.result() for f in first + rest]
    after = httpx.get(server.url + "/metrics").text
    for i, (body, r) in enumerate(zip(BODIES, responses)):
        assert r.status_code == 200, r.text
        got = decode(r.json()["data"][0]["b64_json"])
        assert max_diff(got, expected(reference, body, i, steps[i])) <= 2, body
    forwards = (metric(after, "diffserve_step_running_images_count")
                - metric(before, "diffserve_step_running_images_count"))
    carried = (metric(after, "diffserve_step_running_images_sum")
               - metric(before, "diffserve_step_running_images_sum"))
    if server.mode == "step":  # requests of different adapters shared denoiser forwards
        assert carried / forwards > 2.0, (carried, forwards)
    else:  # request mode: one stack per call, so at least one call per distinct stack
        calls = (metric(after, "diffserve_batch_size_count") - metric(before, "diffserve_batch_size_count"))
        assert calls >= len({tuple(stack_of(b)) for b in BODIES})
    for name in ("A", "B", "C"):
        assert metric(after, "diffserve_lora_requests_total", adapter=name) >= 2


def test_the_official_sdk_picks_an_adapter_by_model_name(server, reference):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused",
                           _strict_response_validation=True)
    made = client.images.generate(model="A", prompt="through the sdk", extra_body={"seed": 3,
                                  "num_inference_steps": 4})
    want = expected(reference, {"prompt": "through the sdk", "model": "A"}, 3, 4)
    assert max_diff(decode(made.data[0].b64_json), want) <= 2
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny-sd", "A", "B", "C"}
    assert models["A"].model_extra["parent"] == "tiny-sd" and models["tiny-sd"].model_extra["parent"] is None


@pytest.mark.parametrize("body, status, param", [
    ({"model": "nope"}, 404, "model"),
    ({"loras": [{"name": "nope"}]}, 404, "loras[0].name"),
    ({"loras": [{"name": "A", "scale": 4.5}]}, 400, "loras[0].scale"),
    ({"loras": [{"name": "A"}, {"name": "A"}]}, 400, "loras"),
    ({"model": "A", "loras": [{"name": "A"}]}, 400, "loras"),
    ({"loras": [{"name": n} for n in "ABC"] + [{"name": "A", "scale": 2}, {"name": "B"}]}, 400, "loras"),
    ({"loras": "A"}, 400, "loras"),
])
def test_bad_adapter_choices_are_clear_errors(server, body, status, param):
    assert_openai_error(post(server, {"prompt": "x", **body}), status, param=param)


def test_edits_take_adapters_too(server):
    import io

    import numpy as np
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.full((64, 64, 3), 90, np.uint8)).save(out, format="PNG")
    with server.client() as c:
        r = c.post("/v1/images/edits", files={"image": ("in.png", out.getvalue(), "image/png")},
                   data={"prompt": "edit", "seed": "1", "loras": '[{"name": "B", "scale": 0.5}]'})
        bad = c.post("/v1/images/edits", files={"image": ("in.png", out.getvalue(), "image/png")},
                     data={"prompt": "edit", "loras": "not json"})
    assert r.status_code == 200, r.text
    assert_openai_error(bad, 400, param="loras")


# -- runtime updates -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runtime(servers):
    """Runtime updates on, with an API key; the adapters' directory is --lora-dir."""
    with servers.take("runtime") as srv:
        srv.outside = servers.outside
        yield srv


def call(server, path, body, key="k", timeout=120):
    with server.client(timeout=timeout, headers={"Authorization": f"Bearer {key}"}) as c:
        return c.post(path, json=body)


def test_runtime_load_use_replace_and_unload(runtime, reference, lora_dir):
    assert call(runtime, "/v1/load_lora_adapter", {"lora_name": "N", "lora_path": str(lora_dir / "B")}).status_code == 200
    r = call(runtime, GENERATE, {"prompt": "n", "model": "N", "seed": 2, "num_inference_steps": 4})
    assert max_diff(decode(r.json()["data"][0]["b64_json"]),
                    expected(reference, {"prompt": "n", "model": "B"}, 2, 4)) <= 2
    # Replace under load: the long request runs on the version it started with, the next on D.
    with ThreadPoolExecutor(2) as pool:
        long = pool.submit(call, runtime, GENERATE, {"prompt": "long", "model": "N", "seed": 5,
                                                     "num_inference_steps": 200})
        wait_for_metric(runtime, "diffserve_num_requests_running", lambda v: v >= 1)
        replaced = call(runtime, "/v1/load_lora_adapter", {"lora_name": "N", "lora_path": "D"})
        assert replaced.status_code == 200, replaced.text
        after = call(runtime, GENERATE, {"prompt": "after", "model": "N", "seed": 6,
                                         "num_inference_steps": 4})
        before = long.result()
    assert max_diff(decode(before.json()["data"][0]["b64_json"]),
                    expected(reference, {"prompt": "long", "model": "B"}, 5, 200)) <= 2
    assert max_diff(decode(after.json()["data"][0]["b64_json"]),
                    expected(reference, {"prompt": "after", "model": "D"}, 6, 4)) <= 2
    assert call(runtime, "/v1/unload_lora_adapter", {"lora_name": "N"}).status_code == 200
    assert_openai_error(call(runtime, GENERATE, {"prompt": "gone", "model": "N"}), 404, "model")
    assert_openai_error(call(runtime, "/v1/unload_lora_adapter", {"lora_name": "N"}), 404)


@pytest.mark.parametrize("path, status", [
    ("/etc", 403), ("../outside", 403), ("link-out", 403), ("file-link-out", 403),
    ("missing", 400)])
def test_a_runtime_path_must_resolve_inside_the_lora_dir(runtime, path, status):
    r = call(runtime, "/v1/load_lora_adapter", {"lora_name": "X", "lora_path": path})
    assert_openai_error(r, status, param="lora_path")


def test_bad_files_are_400_with_the_reason_and_the_server_goes_on(runtime, lora_dir):
    (lora_dir / "junk.safetensors").write_bytes(b"this is not a safetensors file at all")
    good = (lora_dir / "B" / "pytorch_lora_weights.safetensors").read_bytes()
    (lora_dir / "truncated.safetensors").write_bytes(good[: len(good) // 2])
    write_lora("tiny-sdxl", lora_dir / "other-model", rank=4)
    for path in ("junk.safetensors", "truncated.safetensors", "other-model"):
        r = call(runtime, "/v1/load_lora_adapter", {"lora_name": "Y", "lora_path": path})
        error = assert_openai_error(r, 400, param="lora_path")
        assert "LoRA" in error["message"] or "fit" in error["message"], error
    ok = call(runtime, GENERATE, {"prompt": "still here", "model": "A", "num_inference_steps": 2})
    assert ok.status_code == 200
    assert "Y" not in {m["id"] for m in httpx.get(runtime.url + "/v1/models",
                                                  headers={"Authorization": "Bearer k"}).json()["data"]}


def test_runtime_updates_need_the_api_key(runtime, lora_dir):
    r = call(runtime, "/v1/load_lora_adapter", {"lora_name": "Z", "lora_path": "B"}, key="wrong")
    assert_openai_error(r, 401)


def test_runtime_updates_are_off_unless_enabled(servers, lora_dir):
    with servers.take("off") as srv, srv.client() as c:
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "Z", "lora_path": str(lora_dir / "B")})
        assert_openai_error(r, 404)


# -- eviction and start-up -------------------------------------------------------------------


def test_with_max_loras_2_three_adapters_in_turn_stay_exact(servers, reference):
    with servers.take("max-loras") as srv:
        asked = [("A", 0), ("B", 1), ("C", 2), ("A", 3), ("C", 4), ("B", 5)]
        with ThreadPoolExecutor(6) as pool:  # at most 2 resident: some wait for a free slot
            responses = list(pool.map(lambda a: post(srv, {"prompt": f"turn {a[1]}", "model": a[0],
                                                            "seed": a[1], "num_inference_steps": 4}),
                                      asked))
        for (name, i), r in zip(asked, responses):
            assert r.status_code == 200, r.text
            assert max_diff(decode(r.json()["data"][0]["b64_json"]),
                            expected(reference, {"prompt": f"turn {i}", "model": name}, i, 4)) <= 2
        text = httpx.get(srv.url + "/metrics").text
        assert metric(text, "diffserve_lora_evictions_total") >= 1
        assert metric(text, "diffserve_loras_resident") <= 2


def test_a_kohya_file_serves_like_its_diffusers_twin(servers, reference):
    with servers.take("kohya") as srv:
        r = post(srv, {"prompt": "kohya", "model": "K", "seed": 7, "num_inference_steps": 4})
    assert r.status_code == 200, r.text
    assert max_diff(decode(r.json()["data"][0]["b64_json"]),
                    expected(reference, {"prompt": "kohya", "model": "A"}, 7, 4)) <= 2


def test_an_adapter_that_does_not_fit_stops_the_start_naming_it(servers):
    srv = servers.take("misfit")  # a tiny-sdxl adapter for tiny-sd
    assert srv.proc.wait(scaled(120)) == 1
    assert "LoRA adapter 'misfit'" in srv.log, srv.log[-3000:]
