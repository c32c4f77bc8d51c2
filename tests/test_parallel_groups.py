"""One model across several ranks, on the CPU (gloo, one thread a rank), through the server as a
user starts it: Ulysses context parallelism (diffusers') and CFG parallelism (diffserve's) inside
the step engine, with requests joining and leaving between steps. Every image equals the plain
diffusers pipeline alone (as on one device) within 1/255.

- tiny-flux: two groups of Ulysses-2 (four ranks) with the step cache; a rank killed under load;
- tiny-qwen-image and tiny-wan: one group of CFG-2 x Ulysses-2 (four ranks) each (Wan's
  leader in this process, its frames compared before encoding).
"""

from __future__ import annotations

import dataclasses
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from diffserve.executor.model.loading import load_model
from diffserve.executor.model.task_pipelines import task_pipelines
from diffserve.wire.request import WorkItem
from helpers import make_request
from pace import scaled
from diffserve.executor.checks.reference import max_diff, solo
from server import LAUNCHES, Server, decode, metric, pids_titled, serves, spec, wait_for_metric
from test_data_parallel import wait_all_ready

GENERATE = "/v1/images/generations"
THREADS = ("--torch-threads", "1")


@pytest.fixture(scope="module")
@serves(spec("--data-parallel-size", "2", "--ulysses-degree", "2", "--step-cache", "first-block",
             "--max-inference-steps", "400", *THREADS, model="tiny-flux", timeout_s=240))
def flux(request):
    with LAUNCHES.take(request) as srv:
        yield srv


@pytest.fixture(scope="module")
@serves(spec("--ulysses-degree", "2", "--cfg-parallel-size", "2", *THREADS,
             model="tiny-qwen-image", timeout_s=240))
def qwen(request):
    with LAUNCHES.take(request) as srv:
        yield srv


def generate_all(server: Server, bodies: list[dict]) -> list[httpx.Response]:
    """Concurrent requests, each sent once the one before is running: they join the running set
    at different steps."""
    with ThreadPoolExecutor(len(bodies)) as pool, server.client() as c:
        futures = []
        for i, body in enumerate(bodies):
            futures.append(pool.submit(c.post, GENERATE, json=body))
            if i + 1 < len(bodies):
                wait_for_metric(server, "diffserve_step_admissions_total", lambda v, i=i: v > i)
        return [f.result() for f in futures]


def check_images(model: str, bodies: list[dict], answers: list[httpx.Response],
                 bound: int = 1) -> None:
    loaded = load_model(model, torch_threads=1)
    pipelines = task_pipelines(loaded.pipe)
    for body, answer in zip(bodies, answers):
        assert answer.status_code == 200, answer.text
        request = make_request(prompt=body["prompt"], seed=body["seed"], model=model,
                               steps=body["num_inference_steps"],
                               guidance=body.get("guidance_scale", 5.0),
                               negative_prompt=body.get("negative_prompt", ""))
        got = decode(answer.json()["data"][0]["b64_json"])
        assert max_diff(got, solo(loaded, pipelines, request)[0]) <= bound, body


def test_the_group_is_one_executor_of_named_ranks(flux):
    card = httpx.get(flux.url + "/v1/models").json()["data"][0]
    assert card["parallel"] == {"ulysses": 2, "ring": 1, "cfg": 1, "tp": 1, "groups": 2}
    assert {(c["name"], c["rank"]) for c in card["components"]} >= {("transformer", 0),
                                                                    ("transformer", 1)}
    titles = {t.split()[0] for t in map(open_title, pids_titled(flux.proc.pid, "diffserve::executor"))}
    assert titles == {"diffserve::executor-0.r0", "diffserve::executor-0.r1",
                      "diffserve::executor-1.r0", "diffserve::executor-1.r1"}
    text = httpx.get(flux.url + "/metrics").text
    assert metric(text, "diffserve_group_ranks", executor="0") == 2


def open_title(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def test_ulysses_groups_serve_staggered_mixed_requests_as_one_device(flux):
    bodies = [{"prompt": "a red circle" + " on a wide blue field" * i, "seed": 10 + i,
               "num_inference_steps": 3 + 2 * i, "guidance_scale": 3.5} for i in range(4)]
    check_images("tiny-flux", bodies, generate_all(flux, bodies))


def test_the_step_cache_in_a_group_decides_as_on_one_device(flux):
    """Each image's cache decisions are summed over the ranks' shares of its tokens: the group
    reuses exactly the steps one device does, and makes its images."""
    from diffserve.config.flags import ServerConfig
    from diffserve.executor.runtime import build_runtime
    from diffserve.wire.request import WorkItem

    body = {"prompt": "a cached cat", "seed": 4, "num_inference_steps": 12, "cache_threshold": 0.5}
    with flux.client() as c:
        served = c.post(GENERATE, json=body)
    assert served.status_code == 200, served.text
    rt = build_runtime(ServerConfig(model="tiny-flux", step_cache="first-block",
                                    skip_startup_check=True), torch_threads=1)
    engine = rt.step_engine()
    request = make_request(request_id="alone", model="tiny-flux", prompt=body["prompt"], seed=4,
                           steps=12, guidance=3.5)
    import dataclasses

    request = dataclasses.replace(request, cache_threshold=0.5)
    engine.admit([WorkItem(request, 0, 1)], [[]])
    (alone,) = [o for o in iter_finished(engine)]
    assert served.json()["usage"]["cached_steps"] == sum(alone.cached_steps) > 0
    assert max_diff(decode(served.json()["data"][0]["b64_json"]), alone.images[0]) <= 1


def iter_finished(engine):
    while engine:
        yield from engine.step().finished


def test_cfg_and_ulysses_parallel_qwen_image_equals_one_device(qwen):
    """Four ranks: the unconditional rows on two, the conditional on the other two, each pair
    splitting the sequence; requests with and without a negative prompt (Qwen-Image guides only
    with one) and of different prompt lengths share the forwards."""
    card = httpx.get(qwen.url + "/v1/models").json()["data"][0]
    assert card["parallel"] == {"ulysses": 2, "ring": 1, "cfg": 2, "tp": 1, "groups": 1}
    bodies = [{"prompt": "a blue square" + " with a long caption" * i, "seed": 20 + i,
               "num_inference_steps": 3 + i, "guidance_scale": 4.0,
               **({"negative_prompt": "blurry" * (i + 1)} if i % 3 != 1 else {})}
              for i in range(4)]
    check_images("tiny-qwen-image", bodies, generate_all(qwen, bodies))


def test_cfg_and_ulysses_parallel_wan_videos_equal_one_device():
    """Four ranks of tiny Wan (CFG-2 x Ulysses-2): the leader's step engine here (this process
    is rank 0: a video's frames are compared before the lossy MP4 encoding, which hides small
    differences as well as a wrong seed), the other three started as the server starts them.
    Videos with different steps and negative prompts join at different steps; every frame
    equals the pipeline alone within 2/255."""
    from diffserve.config.flags import ServerConfig
    from diffserve.executor.parallel.ranks import LeaderEngine, start_group
    from diffserve.executor.entry import run_follower
    from diffserve.executor.runtime import build_runtime
    from frontend.test_videos import reference

    config = ServerConfig(model="tiny-wan", ulysses_degree=2, cfg_parallel_size=2,
                          torch_threads=1, skip_startup_check=True)
    device, group, link, followers = start_group(config, 0, "cpu,cpu,cpu,cpu", 1, run_follower)
    try:
        rt = build_runtime(config, device, 1, 0, group=group)
        engine = LeaderEngine(rt.step_engine(), link)
        jobs = [make_request(request_id=f"v{i}", model="tiny-wan", width=32, height=32,
                             prompt="a red ball" + " bouncing" * i, seed=30 + i, steps=2 + i,
                             negative_prompt="static" * (i + 1)) for i in range(3)]
        jobs = [dataclasses.replace(j, num_frames=5) for j in jobs]
        plan = {0: jobs[:1], 1: jobs[1:]}  # two join at the second step
        frames, step = {}, 0
        while step == 0 or engine:
            if step in plan:
                assert not engine.admit([WorkItem(r, 0, 1) for r in plan[step]],
                                        [[] for _ in plan[step]])
            for o in engine.step().finished:
                assert o.error is None, o.error
                frames[o.item.request.request_id] = o.images[0]
            step += 1
    finally:
        link.close()
        for p in followers:
            p.join(scaled(60))
        group.close()
    assert all(p.exitcode == 0 for p in followers)
    for j in jobs:
        expected = reference("tiny-wan", j.prompt, j.seed, 5, j.num_inference_steps,
                             negative_prompt=j.negative_prompt)
        assert max_diff(frames[j.request_id], expected) <= 2, j.request_id


def test_a_killed_rank_takes_its_group_down_and_back_every_request_answered(flux):
    """SIGKILL a follower rank of group 1 while both groups run: what group 1 held runs again
    (nothing of it was emitted), group 0 is untouched, group 1 restarts whole and serves again."""
    victim = next(p for p in pids_titled(flux.proc.pid, "diffserve::executor-1.r1"))
    bodies = [{"prompt": f"load {i}", "seed": 40 + i, "num_inference_steps": 200,
               "guidance_scale": 3.5} for i in range(4)]
    with ThreadPoolExecutor(4) as pool, flux.client() as c:
        futures = [pool.submit(c.post, GENERATE, json=b) for b in bodies]
        wait_for_metric(flux, "diffserve_num_requests_running", lambda v: v >= 4)
        os.kill(victim, signal.SIGKILL)
        answers = [f.result() for f in futures]
    assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
    health = wait_all_ready(flux, timeout_s=240)
    assert health["executors"][1]["restarts"] == 1 and health["executors"][0]["restarts"] == 0
    assert metric(httpx.get(flux.url + "/metrics").text, "diffserve_group_restarts_total",
                  executor="1") == 1
    again = [{"prompt": "after the restart", "seed": 7, "num_inference_steps": 3,
              "guidance_scale": 3.5}] * 2
    check_images("tiny-flux", again, generate_all(flux, again))


@pytest.mark.parametrize("flags, message", [
    (("--ulysses-degree", "2", "--tensor-parallel-size", "2"), "--tensor-parallel-size=2 with --ulysses-degree=2"),
    (("--ulysses-degree", "2", "--batching-mode", "request"), "--batching-mode request with a parallel group"),
    (("--cfg-parallel-size", "3"), "--cfg-parallel-size=3 is above the maximum 2"),
    (("--ulysses-degree", "2", "--devices", "cpu,cpu,cpu"), "not a multiple of the group size 2"),
    # What the model cannot do in a group, found by the leader before its other ranks start (the
    # rest of those checks: tests/executor/test_parallel.py).
    (("--model", "tiny-sd", "--ulysses-degree", "2"), "--ulysses-degree: UNet2DConditionModel has no context-parallel plan"),
])
def test_bad_combinations_fail_at_start_naming_the_flag(flags, message, tmp_path):
    from diffserve.serving.launcher import LaunchError, ServerProcess, diffserve_command
    from diffserve.ports import free_port

    port = free_port()
    model = () if "--model" in flags else ("--model", "tiny-flux")
    server = ServerProcess(diffserve_command("--port", str(port), *model, *flags), port,
                           tmp_path / "server.log", env={"OMP_NUM_THREADS": "1"},
                           startup_timeout_s=120)
    with pytest.raises(LaunchError):
        server.launch().wait_ready()
    assert message in server.log, server.log[-2000:]
