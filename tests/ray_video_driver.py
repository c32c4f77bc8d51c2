"""The video part of tests/ray_driver.py's run, on its cluster: ``serve run
diffserve.ray:app`` on the tiny Wan with two replicas, video jobs created through Ray Serve's
proxy (which picks either replica), then each job retrieved, downloaded, listed and deleted
through the proxy many times over: whichever replica a request lands on, it answers for every
job. Then a replica is killed: the one Ray Serve starts in its place takes its rank and its
store, so the completed jobs it held are served again. Returns its findings."""

from __future__ import annotations

import tempfile
import time
import warnings

import httpx

from diffserve.serving.launcher import ServerProcess
from pace import scaled
from ray_driver import RAY_PORT, replicas_running, serving, start_serve, wait_for_replicas

warnings.filterwarnings("ignore", category=DeprecationWarning)
JOBS = 8
# The proxy picks between two idle replicas at random, so eight jobs all land on one of them
# about once in 128 runs; more are made until each replica holds some (all on one: 2**-31).
MOST_JOBS = 32
ROUNDS = 6


def replica_actors() -> list[dict]:
    import ray

    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if "diffserve" in a["name"] and "SERVE_REPLICA" in a["name"]]


def kill_one_replica() -> str:
    """Kill a replica and return its actor's name once Ray has it dead (the name is free again)."""
    import ray

    victim = replica_actors()[0]
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
    deadline = time.monotonic() + scaled(60)
    while any(a["name"] == victim["name"] for a in replica_actors()):
        assert time.monotonic() < deadline, f"{victim['name']} still alive after ray.kill"
        time.sleep(0.2)
    return victim["name"]


def wait_for_replacement(victim: str) -> int:
    """Running replicas once Serve has replaced ``victim``. Serve notices a dead replica only at
    a later health check, and until the new one is up the application reads UNHEALTHY: a count
    taken before the replacement (the victim's name gone, a new one in its place) or while the
    application recovers would be a snapshot of that lag, not of the outcome."""
    deadline = time.monotonic() + scaled(180)
    while True:
        names = {a["name"] for a in replica_actors()}
        running = replicas_running()
        if (len(names) == 2 and victim not in names and running == 2) or time.monotonic() > deadline:
            return running
        time.sleep(0.5)


def holder(video_id: str) -> str:
    """The rank of the replica that made the job (its id ends ``_r<rank>``)."""
    return video_id.rsplit("_r", 1)[1]


def videos(logs, env: dict) -> dict:
    from openai import OpenAI

    videos = tempfile.mkdtemp(prefix="diffserve-ray-videos-")
    found: dict = {}
    start_serve(env)
    serve = ServerProcess(["serve", "run", "diffserve.ray:app", "model=tiny-wan", "num_replicas=2",
                           "torch_threads=1", f"video_dir={videos}"], RAY_PORT,
                          logs / "serve-videos.log", env=env, name="serve run (videos)",
                          startup_timeout_s=scaled(300), stop_timeout_s=scaled(30))
    with serving(serve, found):
        wait_for_replicas(serve)
        client = OpenAI(base_url=f"{serve.url}/v1", api_key="unused", max_retries=0)
        made: list[str] = []
        while len(made) < JOBS or (len({holder(v) for v in made}) < 2 and len(made) < MOST_JOBS):
            made.append(client.videos.create(prompt=f"job {len(made)}", size="32x32", extra_body={
                "num_frames": 5, "num_inference_steps": 2, "seed": len(made)}).id)
        found["holders"] = sorted({holder(video_id) for video_id in made})
        done = {}
        for video_id in made:
            deadline = time.monotonic() + scaled(120)
            while (video := client.videos.retrieve(video_id)).status not in ("completed", "failed"):
                assert time.monotonic() < deadline, video
                time.sleep(0.1)
            done[video_id] = video.status
        found["statuses"] = sorted(set(done.values()))
        with httpx.Client(base_url=serve.url, timeout=scaled(60)) as c:
            answers, contents = set(), set()
            for _ in range(ROUNDS):
                for video_id in made:
                    answers.add(c.get(f"/v1/videos/{video_id}").status_code)
                    r = c.get(f"/v1/videos/{video_id}/content")
                    contents.add((r.status_code, r.headers.get("content-type"),
                                  r.content[4:8] == b"ftyp"))
            found["retrieve"], found["content"] = sorted(answers), sorted(map(list, contents))
            listed = [c.get("/v1/videos", params={"limit": 100}).json() for _ in range(ROUNDS)]
            found["listed_all"] = all({v["id"] for v in page["data"]} == set(made)
                                      for page in listed)
            first = c.get("/v1/videos", params={"limit": 3, "order": "asc"}).json()
            rest = c.get("/v1/videos", params={"limit": 100, "order": "asc",
                                               "after": first["last_id"]}).json()
            found["paged"] = [v["id"] for v in first["data"] + rest["data"]] == sorted(made)
            gone = made[:2]
            found["deleted"] = [c.delete(f"/v1/videos/{v}").status_code for v in gone]
            found["after_delete"] = sorted({c.get(f"/v1/videos/{v}").status_code
                                            for v in gone for _ in range(ROUNDS)})
            replicas = wait_for_replacement(kill_one_replica())
            kept = made[2:]
            deadline = time.monotonic() + scaled(120)
            while True:
                codes = [c.get(f"/v1/videos/{v}/content").status_code for v in kept]
                if set(codes) == {200} or time.monotonic() > deadline:
                    break
                time.sleep(1)
            found["after_replacement"] = sorted(set(codes))
            found["replicas"] = replicas
    return found
