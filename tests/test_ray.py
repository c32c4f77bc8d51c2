"""diffserve on Ray Serve: two replicas on a local Ray cluster serve the same API, and every
image equals a single server's answer to the same request.

Ray advertises the machine's network address and binds its gRPC ports on every interface, so
the whole run happens in a private network namespace that has only the loopback interface
(``unshare -n``, then ``ip link set lo up``): nothing can leave the machine. It also runs in a
private PID namespace, so the cluster's clean-up (``ray stop``) sees only the processes this test
started, never another Ray on the machine, and whatever is left dies with the namespace. Where
that is not permitted the test is skipped, and it never falls back to the machine's interfaces."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import background
from pace import scaled
from background import early

pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install '.[ray]'")

DRIVER = Path(__file__).with_name("ray_driver.py")
DRIVER_S = 900  # the driver's bound, scaled
# The first test here waits for the Ray run, which started with the session and may take the
# driver's whole bound on a slow machine (one core): pytest-timeout's 600 s must not cut it short.
pytestmark = pytest.mark.timeout(scaled(DRIVER_S + 60))


def namespace_command(*command: str) -> list[str]:
    # bash stays the namespace's first process (no exec) and reaps what Ray leaves to it: killed
    # processes that nobody waits for stay zombies, and `ray stop` waits out its grace period
    # for each of them.
    return ["unshare", "--net", "--pid", "--fork", "--mount-proc", "bash", "-c",
            'ip link set lo up && "$@"; exit $?', "bash", *command]


def cannot_isolate() -> str | None:
    """Why the private namespaces cannot be made here, or None."""
    if not (shutil.which("unshare") and shutil.which("ip")):
        return "unshare and ip (util-linux, iproute2) are needed to keep Ray on loopback"
    probe = subprocess.run(namespace_command("true"), capture_output=True, text=True)
    if probe.returncode != 0:
        return ("cannot create private network and PID namespaces here (unshare needs root or "
                f"user namespaces): {probe.stderr.strip()}; Ray is not run on this machine's "
                "interfaces instead")
    return None


@early("ray", weight=10)
def ray_run() -> dict:
    """The driver's findings (one cluster for the image and the video applications); it waits
    on Ray and its replicas most of its minute, so it runs while the session's other tests do."""
    why = cannot_isolate()
    return {"skip": why} if why else run_driver(DRIVER)


@pytest.fixture(scope="module")
def found() -> dict:
    found = background.result("ray")
    if "skip" in found:
        pytest.skip(found["skip"])
    return found


def run_driver(driver: Path) -> dict:
    """What ``driver`` found, run in the private namespaces."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(DRIVER.parent), *sys.path])}
    bin_dir = str(Path(sys.executable).parent)  # `ray` and `serve` of this environment
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    done = subprocess.run(namespace_command(sys.executable, str(driver)), capture_output=True,
                          text=True, env=env, timeout=scaled(DRIVER_S))
    assert done.returncode == 0, done.stderr[-5000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


@pytest.mark.early("ray")
def test_two_replicas_serve_the_same_api_and_images_as_one_server(found):
    found = found["images"]
    assert found["statuses"] == [200] * 16
    assert found["images"] == 24
    assert found["worst_diff"] <= 2
    status, body = found["bad"]
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    assert found["stream_events"] == ["image_generation.partial_image", "image_generation.completed"]
    assert found["models"]["data"][0]["id"] == "tiny-sd" and found["health"] == 200
    assert found["stop"]["exit_code"] is not None, found["stop"]  # Ctrl-C stopped `serve run`


@pytest.mark.early("ray")
def test_the_application_serves_several_models_as_one_server_does(found):
    """The same list of models as ``diffserve serve`` (room for one awake): the second model's
    requests, sent among the default model's, are answered with the plain server's images."""
    found = found["images"]
    assert found["xl_statuses"] == [200] * 4
    assert found["xl_worst_diff"] <= 2
    cards = {card["id"]: card for card in found["models"]["data"]}
    assert list(cards) == ["tiny-sd", "xl"]
    assert {card["location"] for card in cards.values()} <= {"device", "host"}


@pytest.mark.early("ray")
def test_a_replica_whose_second_model_engine_dies_is_replaced(found):
    """Ray Serve's health check watches every model's engine: the second model's scheduler
    killed in one replica replaces the whole replica, and both models serve again."""
    killed = found["images"]["engine_killed"]
    assert killed["replaced"] and killed["replicas"] == 2, killed
    assert killed["after"] == [200, 200, 200], killed


@pytest.mark.early("ray")
def test_serve_run_stops_at_once_while_its_replicas_load(found):
    """Ctrl-C as the second replica starts loading its model: a replica still loading stops
    without waiting for the load to finish (or for Ray's grace period, which waits behind a
    constructor that blocks), within the 30 s ServerProcess.stop allows, and its engine's
    processes (scheduler, executor) go with it. (The first replica may have loaded by then, and
    stops as a serving one does.)"""
    stop = found["stop_while_loading"]
    assert stop["loading_at_stop"] >= 1, stop  # the stop came while a replica loaded
    assert stop["exit_code"] is not None
    assert stop["engines_left"] == [], stop


@pytest.mark.early("ray")
def test_video_jobs_answer_through_whichever_replica_the_proxy_picks(found):
    """Each replica holds the jobs it made; an id routes to its holder from either replica, the
    list merges both, and a replaced replica serves its predecessor's jobs again."""
    found = found["videos"]
    assert found["holders"] == ["0", "1"]  # the proxy spread the jobs over both replicas
    assert found["statuses"] == ["completed"]
    assert found["retrieve"] == [200]
    assert found["content"] == [[200, "video/mp4", True]]
    assert found["listed_all"] and found["paged"]
    assert found["deleted"] == [200, 200] and found["after_delete"] == [404]
    assert found["after_replacement"] == [200] and found["replicas"] == 2
    assert found["stop"]["exit_code"] is not None, found["stop"]


def test_the_application_builder_reads_serve_run_arguments():
    from diffserve.ray import parse_args

    config, options = parse_args({"model": "shapes", "num_replicas": "2",
                                  "dynamic-batch-max-size": "4", "data_parallel_size": "2"})
    assert (config.model, config.dynamic_batch_max_size, config.num_executors) == ("shapes", 4, 2)
    assert options["num_replicas"] == 2 and "autoscaling_config" not in options
    config, options = parse_args({"num_replicas": "auto", "max_replicas": "8"})
    assert options["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 8,
                                             "target_ongoing_requests": 16}
    with pytest.raises(ValueError, match="unknown argument 'nonsense'"):
        parse_args({"nonsense": "1"})


def test_the_application_builder_takes_several_models_as_diffserve_serve_does():
    from diffserve.ray import parse_args

    config, _ = parse_args({"model": "sd=tiny-sd,xl=tiny-sdxl", "resident_models": "1"})
    assert config.served_models == {"sd": "tiny-sd", "xl": "tiny-sdxl"}
    assert config.resident_models == 1
    config, _ = parse_args({"model": ["sd=tiny-sd", "xl=tiny-sdxl"]})  # a Serve config's list
    assert config.served_models == {"sd": "tiny-sd", "xl": "tiny-sdxl"}
    with pytest.raises(ValueError, match="names 'sd' twice"):
        parse_args({"model": "sd=tiny-sd,sd=tiny-sdxl"})


def test_the_shipped_serve_config_names_this_application():
    import yaml

    from diffserve.ray import parse_args

    spec = yaml.safe_load((Path(__file__).parents[1] / "deploy" / "ray" / "serve.yaml").read_text())
    (app,) = spec["applications"]
    assert app["import_path"] == "diffserve.ray:app"
    config, options = parse_args({k: str(v) for k, v in app["args"].items()})
    assert config.model == "shapes" and options["autoscaling_config"]["max_replicas"] == 4
