"""The Videos API end to end, as the official SDK drives it, against ``diffserve serve`` on the
tiny Wan models: every video's frames equal the plain diffusers pipeline alone, its MP4 decodes
to within PSNR 30 dB of them, jobs list, page, cancel and vanish as documented, bad input is a
400 before anything runs, and jobs survive (or fail cleanly across) a restart."""

from __future__ import annotations

import io
import signal
import tempfile
import time
import warnings

import numpy as np
import pytest
from PIL import Image

from diffserve.executor.families.known import family_for
from diffserve.executor.model.loading import load_model
from diffserve.executor.model.task_pipelines import task_pipelines
from diffserve.frontend.videos.encode import decode_mp4
from diffserve.wire.request import ImageRequest
from diffserve.executor.checks.reference import sample_image, solo
from server import LAUNCHES, Server, assert_openai_error, metric, serves, spec
from pace import scaled

openai = pytest.importorskip("openai")
warnings.filterwarnings("ignore", category=DeprecationWarning)  # the SDK marks Sora's API so

PSNR_DB = 30.0


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(float) - b.astype(float)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255 ** 2 / mse)


def reference(model: str, prompt: str, seed: int, frames: int, steps: int, size=(32, 32),
              image=None, task="generate", **extra) -> np.ndarray:
    loaded = load_model(model, torch_threads=1)
    pipelines = task_pipelines(loaded.pipe, family_for(loaded.pipeline_class))
    request = ImageRequest("ref", model, size[0], size[1], task=task, num_inference_steps=steps,
                           guidance_scale=5.0, prompt=prompt, seed=seed, num_frames=frames, **extra)
    return solo(loaded, pipelines, request, image=image)[0]


def content(client, video_id: str, variant: str = "video") -> bytes:
    return client.videos.download_content(video_id, variant=variant).read()


def mp4_frames(data: bytes) -> np.ndarray:
    with tempfile.NamedTemporaryFile(suffix=".mp4") as f:
        f.write(data)
        f.flush()
        return decode_mp4(f.name)


@pytest.fixture(scope="module")
@serves(spec("--torch-threads", "1", "--video-dir", tempfile.mkdtemp(prefix="videos-"),
             "--max-video-jobs", "4", "--max-batch-cost", "32", "--max-running-cost", "32",
             model="tiny-wan"))
def wan(request):
    with LAUNCHES.take(request) as server:
        yield server


def sdk(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_create_and_poll_then_download_is_the_pipeline_alone(wan):
    client = sdk(wan)
    video = client.videos.create_and_poll(
        prompt="a red ball bouncing", size="48x32", seconds="1", poll_interval_ms=50,
        extra_body={"seed": 11, "num_inference_steps": 5, "fps": 8})
    assert video.status == "completed" and video.progress == 100, video
    assert (video.size, video.seconds, video.model) == ("48x32", "1", "tiny-wan")
    assert video.id.startswith("video_") and video.completed_at >= video.created_at
    assert video.expires_at > video.completed_at
    frames = mp4_frames(content(client, video.id))
    expected = reference("tiny-wan", "a red ball bouncing", 11, 9, 5, (48, 32))
    assert frames.shape == expected.shape == (9, 32, 48, 3)  # 1 s x 8 fps -> 4k+1 = 9 frames
    assert psnr(frames, expected) >= PSNR_DB
    thumbnail = Image.open(io.BytesIO(content(client, video.id, "thumbnail")))
    sheet = Image.open(io.BytesIO(content(client, video.id, "spritesheet")))
    assert (thumbnail.format, thumbnail.size) == ("WEBP", (48, 32))
    assert (sheet.format, sheet.size) == ("JPEG", (3 * 48, 3 * 32))  # 9 frames, 3 x 3


def test_the_sprite_sheet_and_the_mp4_show_the_pipelines_frames(wan):
    from diffserve.frontend.videos import encode

    client = sdk(wan)
    video = client.videos.create_and_poll(prompt="exact frames", size="32x32", poll_interval_ms=50,
                                          extra_body={"seed": 4, "num_frames": 5,
                                                      "num_inference_steps": 4})
    expected = reference("tiny-wan", "exact frames", 4, 5, 4)
    sheet = np.asarray(Image.open(io.BytesIO(content(client, video.id, "spritesheet"))))
    assert psnr(sheet, encode.sprite_sheet(expected)) >= PSNR_DB
    assert psnr(mp4_frames(content(client, video.id)), expected) >= PSNR_DB


def test_list_pages_by_cursor_in_both_orders(wan):
    client = sdk(wan)
    made = [client.videos.create(prompt=f"listed {i}", size="32x32",
                                 extra_body={"num_frames": 1, "num_inference_steps": 1}).id
            for i in range(3)]
    with wan.client() as c:
        first = c.get("/v1/videos", params={"limit": 2, "order": "desc"}).json()
        assert [v["id"] for v in first["data"]] == made[::-1][:2] and first["has_more"]
        rest = c.get("/v1/videos", params={"limit": 2, "after": first["last_id"]}).json()
        assert rest["data"][0]["id"] == made[0]
        ascending = c.get("/v1/videos", params={"order": "asc", "limit": 100}).json()["data"]
        ids = [v["id"] for v in ascending]
        assert ids.index(made[0]) < ids.index(made[1]) < ids.index(made[2])
        assert_openai_error(c.get("/v1/videos", params={"after": "video_nope"}), 400, "after")
    assert {v.id for v in client.videos.list(limit=100)} >= set(made)
    for video_id in made:  # the module's server is left with nothing queued for the next test
        wait_status(client, video_id, {"completed"})


def wait_status(client, video_id: str, wanted: set[str], timeout_s: float = 60):
    deadline = time.monotonic() + scaled(timeout_s)
    while (video := client.videos.retrieve(video_id)).status not in wanted:
        assert time.monotonic() < deadline, video
        time.sleep(0.02)
    return video


def test_delete_queued_running_and_finished_then_404(wan):
    client = sdk(wan)
    slow = dict(extra_body={"num_frames": 65, "num_inference_steps": 200})
    running = client.videos.create(prompt="long one", size="32x32", **slow)
    queued = client.videos.create(prompt="waits behind it", size="48x48", **slow)  # no room yet
    seen = wait_status(client, running.id, {"in_progress"})
    assert 0 <= seen.progress < 90
    assert client.videos.retrieve(queued.id).status == "queued"
    assert client.videos.delete(running.id).deleted
    assert client.videos.retrieve(queued.id).status in ("queued", "in_progress")
    assert client.videos.delete(queued.id).deleted
    finished = client.videos.create_and_poll(prompt="short", size="32x32", poll_interval_ms=50,
                                              extra_body={"num_frames": 1, "num_inference_steps": 1})
    assert client.videos.delete(finished.id).deleted
    for video in (queued, running, finished):
        with pytest.raises(openai.NotFoundError):
            client.videos.delete(video.id)
        with pytest.raises(openai.NotFoundError):
            client.videos.retrieve(video.id)
        with pytest.raises(openai.NotFoundError):
            client.videos.download_content(video.id)
    with wan.client() as c:
        cancelled = metric(c.get("/metrics").text, "diffserve_video_jobs_finished_total",
                           status="cancelled")
        assert cancelled >= 2
        # The cancelled job left the engine at its next step: nothing runs any more.
        deadline = time.monotonic() + scaled(30)
        while metric(c.get("/metrics").text, "diffserve_num_requests_running") > 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_unknown_ids_are_404_with_the_openai_error_body(wan):
    with wan.client() as c:
        for method, path in (("GET", "/v1/videos/video_unknown"), ("DELETE", "/v1/videos/video_x"),
                             ("GET", "/v1/videos/video_unknown/content")):
            assert_openai_error(c.request(method, path), 404, "video_id", "not_found")


@pytest.mark.parametrize("fields, param", [
    ({"prompt": "x", "size": "40x32"}, "size"),  # off the stride of 16
    ({"prompt": "x", "num_frames": "8"}, "num_frames"),  # breaks 4k+1
    ({"prompt": "x", "num_frames": "100000"}, "num_frames"),  # above --max-video-frames
    ({"size": "32x32"}, "prompt"),  # missing
    ({"prompt": "x", "n": "2"}, "n"),  # not a field of a video
    ({"prompt": "x", "guidance_scale_2": "2"}, "guidance_scale_2"),  # one expert only
    ({"prompt": "x", "priority": "2000000"}, "priority"),  # the images API's bound
])
def test_bad_input_is_a_400_naming_the_field(wan, fields, param):
    with wan.client() as c:
        form = {k: (None, v) for k, v in fields.items()}  # multipart, as the SDK sends it
        error = assert_openai_error(c.post("/v1/videos", files=form), 400)
        assert error["param"] == param, error
        assert_openai_error(c.post("/v1/videos", json={k: int(v) if v.isdigit() else v
                                                          for k, v in fields.items()}), 400)


def test_an_image_for_a_text_only_model_is_a_400(wan):
    image, _ = sample_image(32)
    data = io.BytesIO()
    Image.fromarray(image).save(data, format="PNG")
    with pytest.raises(openai.BadRequestError) as error:
        sdk(wan).videos.create(prompt="x", input_reference=("first.png", data.getvalue(), "image/png"))
    assert error.value.body["param"] == "input_reference"
    assert error.value.body["code"] == "unsupported_task"


def test_images_api_on_a_video_model_points_to_the_videos_api(wan):
    with wan.client() as c:
        error = assert_openai_error(c.post("/v1/images/generations", json={"prompt": "x"}), 400)
        assert "/v1/videos" in error["message"]


def test_metrics_count_jobs_and_video_seconds(wan):
    sdk(wan).videos.create_and_poll(prompt="counted", size="32x32", poll_interval_ms=50,
                                    extra_body={"num_frames": 9, "fps": 9, "num_inference_steps": 1})
    with wan.client() as c:
        text = c.get("/metrics").text
    assert metric(text, "diffserve_video_jobs", status="completed") >= 1
    assert metric(text, "diffserve_video_seconds_generated_total") >= 1.0
    assert metric(text, "diffserve_video_run_seconds_count") >= 1


def test_too_many_queued_jobs_is_a_429(wan):
    client = sdk(wan)
    ids, refused = [], None
    for i in range(8):
        try:
            ids.append(client.videos.create(prompt=f"flood {i}", size="48x48", extra_body={
                "num_frames": 33, "num_inference_steps": 200}).id)
        except openai.RateLimitError as error:
            refused = error
            break
    assert refused is not None and refused.body["code"] == "overloaded"
    for video_id in ids:
        client.videos.delete(video_id)


@pytest.mark.server("--torch-threads", "1", model="tiny-wan-i2v")
def test_image_to_video_through_the_sdk_is_the_pipeline_alone(own_server):
    image, _ = sample_image(32, seed=3)
    data = io.BytesIO()
    Image.fromarray(image).save(data, format="PNG")
    with own_server as server:
        client = sdk(server)
        video = client.videos.create_and_poll(
            prompt="it moves", size="32x32", poll_interval_ms=50,
            input_reference=("first.png", data.getvalue(), "image/png"),
            extra_body={"seed": 2, "num_frames": 5, "num_inference_steps": 4})
        assert video.status == "completed", video
        frames = mp4_frames(content(client, video.id))
        with pytest.raises(openai.BadRequestError) as error:  # it needs its first frame
            client.videos.create(prompt="no image")
        assert error.value.body["param"] == "input_reference"
    expected = reference("tiny-wan-i2v", "it moves", 2, 5, 4, image=image, task="image-to-video")
    assert psnr(frames, expected) >= PSNR_DB


RESTARTED = ("--torch-threads", "1", "--video-dir", tempfile.mkdtemp(prefix="videos-restart-"),
             "--max-running-cost", "16")


@pytest.mark.server(*RESTARTED, model="tiny-wan")  # the first of the two servers
def test_restart_keeps_completed_jobs_and_fails_the_ones_a_kill_interrupted(own_server):
    args = RESTARTED
    with own_server as server:
        client = sdk(server)
        done = client.videos.create_and_poll(prompt="kept", size="32x32", poll_interval_ms=50,
                                             extra_body={"num_frames": 5, "num_inference_steps": 2})
        kept = content(client, done.id)
        cut = client.videos.create(prompt="cut short", size="32x32",
                                   extra_body={"num_frames": 33, "num_inference_steps": 200})
        wait_status(client, cut.id, {"in_progress"})
        waiting = client.videos.create(prompt="never started", size="48x48",
                                       extra_body={"num_frames": 33, "num_inference_steps": 200})
        server.send_signal(signal.SIGKILL)
        server.proc.wait(scaled(30))
    with Server(*args, model="tiny-wan") as server:
        client = sdk(server)
        again = client.videos.retrieve(done.id)
        assert (again.status, again.progress) == ("completed", 100)
        assert content(client, done.id) == kept
        for video in (cut, waiting):
            failed = client.videos.retrieve(video.id)
            assert failed.status == "failed" and failed.error.code == "server_restarted", failed
        assert {v.id for v in client.videos.list(limit=100)} == {done.id, cut.id, waiting.id}
        # It serves on: a new job on the same directory completes.
        assert client.videos.create_and_poll(
            prompt="after", size="32x32", poll_interval_ms=50,
            extra_body={"num_frames": 1, "num_inference_steps": 1}).status == "completed"


@pytest.mark.server("--torch-threads", "1", "--batching-mode", "request", model="tiny-wan22")
def test_request_mode_serves_a_two_expert_model_with_its_second_guidance_scale(own_server):
    """Any video pipeline runs in request mode (one pipeline call a batch): here Wan 2.2 with
    guidance_scale_2 for its low-noise expert."""
    with own_server as server:
        client = sdk(server)
        video = client.videos.create_and_poll(
            prompt="two experts", size="32x32", poll_interval_ms=50,
            extra_body={"seed": 9, "num_frames": 5, "num_inference_steps": 6,
                        "guidance_scale_2": 2.0})
        assert video.status == "completed", video
        frames = mp4_frames(content(client, video.id))
    expected = reference("tiny-wan22", "two experts", 9, 5, 6, guidance_scale_2=2.0)
    assert psnr(frames, expected) >= PSNR_DB
    assert psnr(frames, reference("tiny-wan22", "two experts", 9, 5, 6)) < psnr(frames, expected)
