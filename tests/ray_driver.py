"""Run inside a private network namespace that has only the loopback interface (see
tests/test_ray.py): a local Ray cluster, ``serve run diffserve.ray:app`` with two replicas of
two models (room for one awake), and a plain ``diffserve serve`` of the same models for
reference, all on 127.0.0.1; then, on the same cluster, the video
application of tests/ray_video_driver.py. Prints one JSON line of findings, by part."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from diffserve.serving.launcher import ServerProcess
from pace import scaled
from server import pids_titled, process_title

RAY_PORT = 8000  # Ray Serve's HTTP proxy, its default address inside the namespace
GCS_PORT = 6379  # the cluster's head
COUNT = 16
XL_COUNT = 4  # requests for the second model, sent among the default model's
# The same list of models on both: the default named by its path, a second one by its own.
MODELS = ("tiny-sd", "xl=tiny-sdxl")


def image(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB")).astype(int)


def replicas_running() -> int:
    """Running replicas of the deployment, from Ray Serve itself (the `serve status` command
    would need Ray's dashboard, which this cluster runs without)."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
    app = serve.status().applications.get("default")
    if app is None or app.status != "RUNNING":
        return 0
    return app.deployments["diffserve"].replica_states.get("RUNNING", 0)


def pin_authentication() -> None:
    """Token authentication with a token of this run's own, for every Ray process it starts
    (they inherit this environment): a token a machine has kept from an earlier cluster
    (~/.ray/auth_token, which Ray would otherwise pick up on its own) plays no part."""
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))


def start_cluster() -> tuple[Path, dict]:
    """A local Ray cluster of this run's own: (its log directory, the environment to reach it)."""
    pin_authentication()
    logs = Path(tempfile.mkdtemp(prefix="diffserve-ray-"))
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
           # Every line of every replica: the driver counts lines that two replicas write at once,
           # which Ray's log deduplication would fold into one.
           "RAY_DEDUP_LOGS": "0",
           # Serve gives a new proxy 5 s to answer its first ready check, then kills it and
           # `serve run` fails; on a busy 2-core machine the proxy's process alone can take
           # longer to start (docs/operations.md, "Ray Serve on a busy node").
           "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60"}
    # Its session files in a directory of its own, not the machine's shared /tmp/ray; with
    # that, clients find the cluster by its address, not by the file /tmp/ray would hold.
    subprocess.run(["ray", "start", "--head", f"--port={GCS_PORT}", "--include-dashboard=false",
                    "--num-cpus=4", "--disable-usage-stats", f"--temp-dir={logs / 'ray'}"],
                   check=True, env=env, capture_output=True, timeout=scaled(180))
    env["RAY_ADDRESS"] = os.environ["RAY_ADDRESS"] = f"127.0.0.1:{GCS_PORT}"
    return logs, env


# Starts Serve's controller and HTTP proxy on the running cluster, as `serve run` does.
START_SERVE = "import ray; from ray import serve; ray.init(); serve.start()"


def start_serve(env: dict) -> None:
    """Serve's controller and HTTP proxy, up before ``serve run`` asks for them. ``serve run``
    waits 60 s for the proxy (a constant in Ray), which a busy one-core machine can exceed; the
    proxy comes up in the end, and a later start finds it ready. So the start is asked again,
    within a bound scaled to the machine; ``serve run`` then finds both running."""
    deadline = time.monotonic() + scaled(600)
    while True:
        done = subprocess.run([sys.executable, "-c", START_SERVE], env=env, capture_output=True, text=True,
                              timeout=scaled(600))
        if done.returncode == 0:
            return
        if "HTTP proxies not available" not in done.stderr or time.monotonic() > deadline:
            raise RuntimeError("Serve did not start:\n" + done.stderr[-3000:])


def wait_for_replicas(serve: ServerProcess, count: int = 2) -> None:
    deadline = time.monotonic() + scaled(180)
    while replicas_running() < count:  # /health answers once the first replica is up
        if time.monotonic() > deadline:
            raise RuntimeError(f"{count} replicas did not come up:\n" + serve.log[-3000:])
        time.sleep(1)


def ctrl_c(serve: ServerProcess) -> dict:
    """Stop a ``serve run`` as an operator stops it (SIGINT; killed past its bound): its exit
    code (None if it had to be killed) and how long it took."""
    started = time.monotonic()
    try:
        code = serve.stop()
    except subprocess.TimeoutExpired:  # stop() has killed it
        code = None
    return {"exit_code": code, "seconds": round(time.monotonic() - started, 2)}


@contextlib.contextmanager
def serving(serve: ServerProcess, found: dict):
    """``with serve:``, but stopped by :func:`ctrl_c`, with how it went in ``found["stop"]``."""
    serve.start()
    try:
        yield serve
    finally:
        found["stop"] = ctrl_c(serve)


def stop_cluster(env: dict) -> None:
    import ray

    if ray.is_initialized():  # leave first: a driver whose cluster goes away exits with 1
        ray.shutdown()
    # This runs in the test's own PID namespace: `ray stop` sees only the cluster it started.
    subprocess.run(["ray", "stop", "--force"], env=env, capture_output=True, timeout=scaled(120))


def stop_while_loading(logs: Path, env: dict) -> dict:
    """``serve run`` stopped (Ctrl-C) while its replicas load their model: how it went."""
    start_serve(env)
    serve = ServerProcess(["serve", "run", "diffserve.ray:app", "model=tiny-sd",
                           "num_replicas=2", "torch_threads=1"], RAY_PORT,
                          logs / "serve-stopped.log", env=env, name="serve run",
                          stop_timeout_s=scaled(30)).launch()
    # Both replicas' engines have started their executors, which now load the model (seconds:
    # they import torch first). The log is the only event there is.
    deadline = time.monotonic() + scaled(180)
    while serve.log.count("diffserve.scheduler.supervisor: started executor 0") < 2:
        if serve.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the replicas' executors did not both start:\n" + serve.log[-3000:])
        time.sleep(0.05)
    loading = 2 - serve.log.count("diffserve.scheduler.service: executor 0 is ready")
    started = time.monotonic()
    stopped = ctrl_c(serve)
    # A stopped replica kills its engine (scheduler and executor) whether it had loaded or not:
    # once `serve run` has exited, none may be left in this namespace (the plain server is gone).
    deadline = time.monotonic() + scaled(30)
    while (left := pids_titled(1, "diffserve::")) and time.monotonic() < deadline:  # 1: its first
        time.sleep(0.1)
    # How each replica's start ended, in its worker's log file, where Ray wrote it in time (a
    # replica killed at once by Serve's shutdown may write nothing): for the record.
    said = [path.read_text(errors="replace") for path in (logs / "ray").rglob("worker-*.err")]
    return {**stopped, "loading_at_stop": loading,
            "engines_left": [process_title(p) for p in left],
            "engines_gone_s": round(time.monotonic() - started, 2),
            "stopped_while_loading": sum(text.count("StartupError: the replica was stopped while "
                                                    "its model loaded") for text in said)}


def scheduler_of(executor_pid: int) -> int:
    return int(Path(f"/proc/{executor_pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def engine_killed(serve: ServerProcess, c: httpx.Client) -> dict:
    """The second model's scheduler killed in one replica: Ray Serve's health check, which
    watches every model's engine, replaces that whole replica (its default model's engine goes
    too), and both models serve again."""
    executors = {name: m["executors"][0]["pid"]
                 for name, m in c.get(f"{serve.url}/health").json()["models"].items()}
    xl, sd = scheduler_of(executors["xl"]), scheduler_of(executors["tiny-sd"])
    os.kill(xl, signal.SIGKILL)
    deadline = time.monotonic() + scaled(240)
    while alive(sd) and time.monotonic() < deadline:  # the replica's stop (no event reaches here)
        time.sleep(0.5)
    replaced = not alive(sd)
    while replicas_running() < 2 and time.monotonic() < deadline:
        time.sleep(1)
    after = [c.post(f"{serve.url}/v1/images/generations",
                    json={"model": model, "prompt": "after", "seed": 3}).status_code
             for model in ("xl", "tiny-sd", "xl")]
    return {"replaced": replaced, "replicas": replicas_running(), "after": after}


def main() -> None:
    # Ctrl-C works on what this starts, as in a terminal, even where this was started with SIGINT
    # ignored (a shell's background job, a runner that ignores it): an ignored signal is inherited
    # through exec, and a Python program that starts with SIGINT ignored (`serve run`) keeps
    # ignoring it. A handler is not inherited: the children start with SIGINT at its default.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # The plain server needs no cluster: it starts while the cluster does.
    single = ServerProcess.diffserve("--model", ",".join(MODELS), "--torch-threads", "1",
                                     log_path=Path(tempfile.mkdtemp(prefix="diffserve-single-"))
                                     / "single.log", startup_timeout_s=scaled(300),
                                     stop_timeout_s=scaled(30)).launch()
    env: dict = {}
    found: dict = {}
    result = {"images": found}
    try:
        logs, env = start_cluster()
        start_serve(env)
        serve = ServerProcess(["serve", "run", "diffserve.ray:app", "model=" + ",".join(MODELS),
                               "resident_models=1", "num_replicas=2", "torch_threads=1"],
                              RAY_PORT, logs / "serve.log",
                              env=env, name="serve run", startup_timeout_s=scaled(300),
                              stop_timeout_s=scaled(30))
        with serving(serve, found):
            single.wait_ready()
            wait_for_replicas(serve)
            bodies = [{"prompt": f"request {i} of {COUNT}", "seed": 40 + 7 * i, "n": 1 + i % 2}
                      for i in range(COUNT)]
            for i in range(XL_COUNT):  # among the others, for the model asleep at start
                bodies.insert(4 * i + 2, {"model": "xl", "prompt": f"xl {i}", "seed": 5 + i})
            with httpx.Client(timeout=scaled(180)) as c, ThreadPoolExecutor(len(bodies)) as pool:
                on_ray = list(pool.map(lambda b: c.post(f"{serve.url}/v1/images/generations", json=b), bodies))
                alone = [c.post(f"{single.url}/v1/images/generations", json=b) for b in bodies]
                found["xl_statuses"] = [r.status_code for r, b in zip(on_ray, bodies) if "model" in b]
                found["xl_worst_diff"] = max(
                    (int(np.abs(image(x.json()["data"][0]["b64_json"])
                                - image(y.json()["data"][0]["b64_json"])).max())
                     for x, y, b in zip(on_ray, alone, bodies) if "model" in b
                     and x.status_code == 200), default=None)
                on_ray, alone = ([r for r, b in zip(rs, bodies) if "model" not in b]
                                 for rs in (on_ray, alone))
                found["statuses"] = [r.status_code for r in on_ray]
                found["worst_diff"] = max(
                    int(np.abs(image(a["b64_json"]) - image(b["b64_json"])).max())
                    for x, y in zip(on_ray, alone) if x.status_code == 200
                    for a, b in zip(x.json()["data"], y.json()["data"]))
                found["images"] = sum(len(r.json()["data"]) for r in on_ray if r.status_code == 200)
                bad = c.post(f"{serve.url}/v1/images/generations", json={"prompt": "x", "size": "3x3"})
                found["bad"] = [bad.status_code, bad.json()]
                stream = c.post(f"{serve.url}/v1/images/generations",
                                json={"prompt": "streamed", "stream": True, "partial_images": 1,
                                      "num_inference_steps": 4, "seed": 1})
                found["stream_events"] = [line.split(": ", 1)[1] for line in stream.text.splitlines()
                                          if line.startswith("event: ")]
                found["models"] = c.get(f"{serve.url}/v1/models").json()
                found["health"] = c.get(f"{serve.url}/health").status_code
                found["engine_killed"] = engine_killed(serve, c)
        single.stop()
        result["stop_while_loading"] = stop_while_loading(logs, env)
        import ray

        ray.shutdown()  # the Serve controller went with `serve run`: the next status asks anew
        from ray_video_driver import videos

        result["videos"] = videos(logs, env)
    finally:
        if single.proc.poll() is None:
            single.stop()
        if env:
            stop_cluster(env)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
