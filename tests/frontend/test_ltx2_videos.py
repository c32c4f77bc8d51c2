"""LTX-2 (video with its sound track) through the Videos API as the official SDK drives it,
against ``diffserve serve`` on tiny-ltx2: four jobs at once share forwards and each MP4 has an
H.264 stream and an AAC stream at the model's rate, its frames the plain pipeline's; ``audio:
false`` leaves the sound out; /v1/models says the model makes sound; bad frame counts and sizes
are 400s naming the field; a restart keeps completed jobs with their sound; a job with a LoRA
adapter (loaded at run time) is the pipeline with that adapter, and an unknown one is a 400."""

from __future__ import annotations

import io
import json
import signal
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
from pace import scaled
from server import LAUNCHES, Server, assert_openai_error, metric, serves, spec

from diffserve.executor.checks.reference import solo
from diffserve.executor.families.known import family_for
from diffserve.executor.model.loading import load_model
from diffserve.executor.model.task_pipelines import task_pipelines
from diffserve.frontend.videos.encode import decode_mp4, decode_sound, encode_mp4
from diffserve.wire.request import ImageRequest

openai = pytest.importorskip("openai")
warnings.filterwarnings("ignore", category=DeprecationWarning)  # the SDK marks Sora's API so

MODEL = "tiny-ltx2"
RATE = 8000  # tiny-ltx2's vocoder
MIN_PSNR = 35.0
LORA_DIR = tempfile.mkdtemp(prefix="loras-ltx2-")


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(float) - b.astype(float)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255 ** 2 / mse)


@pytest.fixture(scope="module")
@serves(spec("--torch-threads", "1", "--video-dir", tempfile.mkdtemp(prefix="videos-ltx2-"),
             "--max-video-jobs", "8", "--enable-lora-runtime-updates", "--lora-dir", LORA_DIR,
             model=MODEL))
def ltx2(request):
    with LAUNCHES.take(request) as server:
        yield server


def sdk(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def mp4(client, video_id: str, directory) -> tuple:
    """The MP4's frames and sound track (None where it has none)."""
    path = directory / f"{video_id}.mp4"
    path.write_bytes(client.videos.download_content(video_id).read())
    return decode_mp4(path), decode_sound(path)


def reference(prompt: str, seed: int, frames: int, steps: int) -> np.ndarray:
    loaded = load_model(MODEL, torch_threads=1)
    pipelines = task_pipelines(loaded.pipe, family_for(loaded.pipeline_class))
    request = ImageRequest("ref", MODEL, 32, 32, num_inference_steps=steps, guidance_scale=4.0,
                           prompt=prompt, seed=seed, num_frames=frames)
    return solo(loaded, pipelines, request)[0]


def test_the_model_card_says_it_makes_sound(ltx2):
    (card,) = sdk(ltx2).models.list().data
    assert card.model_extra["audio_sample_rate"] == RATE
    assert card.model_extra["num_frames"] == 9 and card.model_extra["frame_stride"] == 2
    assert card.model_extra["task_modes"] == {"generate": "step", "rollout": "step",
                                              "image-to-video": "step"}


def test_four_jobs_at_once_share_forwards_each_with_video_and_sound(ltx2, tmp_path):
    client = sdk(ltx2)
    with ltx2.client() as c:
        before = metric(c.get("/metrics").text, "diffserve_step_running_images_count")
    jobs = [dict(prompt=f"a drum solo {i}", seed=30 + i, steps=4 + i % 2) for i in range(4)]

    def make(job):
        return client.videos.create_and_poll(
            prompt=job["prompt"], size="32x32", poll_interval_ms=50,
            extra_body={"seed": job["seed"], "num_frames": 9,
                        "num_inference_steps": job["steps"]})

    with ThreadPoolExecutor(4) as pool:
        videos = list(pool.map(make, jobs))
    with ltx2.client() as c:
        forwards = metric(c.get("/metrics").text, "diffserve_step_running_images_count") - before
    assert forwards < sum(job["steps"] for job in jobs)  # fewer than each job alone
    for job, video in zip(jobs, videos):
        assert video.status == "completed" and video.model_extra["audio"] is True, video
        frames, sound = mp4(client, video.id, tmp_path)
        assert sound is not None and sound.sample_rate == RATE and len(sound.samples) == 2
        # 9 frames at 24 fps: 0.375 s of sound (AAC pads it to whole frames of 1024 samples).
        assert 0.375 * RATE <= sound.samples.shape[1] <= 0.375 * RATE + 2048
        expected = reference(job["prompt"], job["seed"], 9, job["steps"])
        alone = tmp_path / f"{video.id}-alone.mp4"
        encode_mp4(expected, 24, alone)  # the pipeline's frames through the same encoder
        assert frames.shape == expected.shape == (9, 32, 32, 3)
        assert psnr(frames, decode_mp4(alone)) >= MIN_PSNR


def test_image_to_video_through_the_sdk_is_the_pipeline_alone(ltx2, tmp_path):
    from PIL import Image

    from diffserve.executor.checks.reference import sample_image

    image, _ = sample_image(32, seed=3)
    data = io.BytesIO()
    Image.fromarray(image).save(data, format="PNG")
    client = sdk(ltx2)
    video = client.videos.create_and_poll(
        prompt="it starts here", size="32x32", poll_interval_ms=50,
        input_reference=("first.png", data.getvalue(), "image/png"),
        extra_body={"seed": 8, "num_frames": 9, "num_inference_steps": 3})
    assert video.status == "completed" and video.model_extra["audio"] is True, video
    frames, sound = mp4(client, video.id, tmp_path)
    assert sound is not None and sound.sample_rate == RATE
    loaded = load_model(MODEL, torch_threads=1)
    pipelines = task_pipelines(loaded.pipe, family_for(loaded.pipeline_class))
    request = ImageRequest("ref", MODEL, 32, 32, task="image-to-video", num_inference_steps=3,
                           guidance_scale=4.0, prompt="it starts here", seed=8, num_frames=9)
    expected = solo(loaded, pipelines, request, image=image)[0]
    alone = tmp_path / "alone.mp4"
    encode_mp4(expected, 24, alone)
    assert psnr(frames, decode_mp4(alone)) >= MIN_PSNR


def test_audio_false_makes_a_silent_mp4(ltx2, tmp_path):
    client = sdk(ltx2)
    video = client.videos.create_and_poll(prompt="quiet", size="64x32", poll_interval_ms=50,
                                          extra_body={"num_frames": 5, "num_inference_steps": 2,
                                                      "audio": False})
    assert video.status == "completed" and video.model_extra["audio"] is False, video
    frames, sound = mp4(client, video.id, tmp_path)
    assert frames.shape == (5, 32, 64, 3) and sound is None


@pytest.mark.parametrize("fields, param", [
    ({"prompt": "x", "size": "48x32"}, "size"),  # off the stride of 32
    ({"prompt": "x", "num_frames": 8}, "num_frames"),  # breaks 2k+1
    ({"prompt": "x", "fps": 12}, "fps"),  # the sound is made for 24 fps
])
def test_bad_input_is_a_400_naming_the_field(ltx2, fields, param):
    with ltx2.client() as c:
        error = assert_openai_error(c.post("/v1/videos", json=fields), 400)
        assert error["param"] == param, error


def test_a_job_with_an_adapter_is_the_pipeline_with_it(ltx2, tmp_path):
    """The adapter is loaded at run time (and unloaded after), so the other tests' server
    serves none. The SDK sends a multipart form, where ``loras`` is its JSON text."""
    from pathlib import Path

    from diffusers import DiffusionPipeline

    from diffserve.builders.random.loras import write_lora
    from diffserve.builders.registry import resolve_model
    from diffserve.executor.checks.reference import with_adapters

    path = write_lora(MODEL, Path(LORA_DIR) / "V", rank=4, seed=5)
    client = sdk(ltx2)
    with ltx2.client() as c:
        assert c.post("/v1/load_lora_adapter",
                      json={"lora_name": "V", "lora_path": path}).status_code == 200
        error = assert_openai_error(c.post("/v1/videos", json={
            "prompt": "x", "loras": [{"name": "nope", "scale": 1.0}]}), 404)
        assert error["param"] == "loras[0].name", error
        error = assert_openai_error(c.post("/v1/videos", json={
            "prompt": "x", "loras": [{"name": "V", "scale": 9.0}]}), 400)
        assert error["param"] == "loras[0].scale", error
    try:
        job = {"prompt": "a lit stage", "size": "32x32", "poll_interval_ms": 50}
        fields = {"seed": 12, "num_frames": 9, "num_inference_steps": 3}
        plain = client.videos.create_and_poll(**job, extra_body=fields)
        adapted = client.videos.create_and_poll(
            **job, extra_body={**fields, "loras": json.dumps([{"name": "V", "scale": 0.8}])})
        by_model = client.videos.create_and_poll(**job, model="V", extra_body=fields)
    finally:
        with ltx2.client() as c:
            assert c.post("/v1/unload_lora_adapter", json={"lora_name": "V"}).status_code == 200
    assert plain.status == adapted.status == by_model.status == "completed"
    pipe = DiffusionPipeline.from_pretrained(resolve_model(MODEL))
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(path, adapter_name="V")
    loaded = SimpleNamespace(pipe=pipe, call_kwargs=load_model(MODEL, torch_threads=1).call_kwargs)
    frames = {}
    for name, video in (("plain", plain), ("adapted", adapted), ("by_model", by_model)):
        frames[name], _ = mp4(client, video.id, tmp_path)
    for name, loras in (("adapted", [("V", 0.8)]), ("by_model", [("V", 1.0)])):
        request = ImageRequest("ref", MODEL, 32, 32, num_inference_steps=3, guidance_scale=4.0,
                               prompt="a lit stage", seed=12, num_frames=9, loras=tuple(loras))
        adapted_pipe = SimpleNamespace(pipe=with_adapters(pipe, loras),
                                       call_kwargs=loaded.call_kwargs)
        expected = solo(adapted_pipe, {}, request)[0]
        alone = tmp_path / f"{name}-alone.mp4"
        encode_mp4(expected, 24, alone)
        assert psnr(frames[name], decode_mp4(alone)) >= MIN_PSNR, name
    # The adapter shows: further from the plain job than the match above allows.
    assert psnr(frames["plain"], frames["adapted"]) < MIN_PSNR - 5


RESTARTED = ("--torch-threads", "1", "--video-dir", tempfile.mkdtemp(prefix="videos-ltx2-restart-"))


@pytest.mark.server(*RESTARTED, model=MODEL)  # the first of the two servers
def test_a_restart_keeps_completed_jobs_with_their_sound(own_server, tmp_path):
    with own_server as server:
        client = sdk(server)
        done = client.videos.create_and_poll(prompt="kept with sound", size="32x32",
                                             poll_interval_ms=50,
                                             extra_body={"num_frames": 5, "num_inference_steps": 2})
        kept = client.videos.download_content(done.id).read()
        server.send_signal(signal.SIGKILL)
        server.proc.wait(scaled(30))
    with Server(*RESTARTED, model=MODEL) as server:
        client = sdk(server)
        again = client.videos.retrieve(done.id)
        assert (again.status, again.progress, again.model_extra["audio"]) == ("completed", 100,
                                                                               True)
        assert client.videos.download_content(done.id).read() == kept
        _, sound = mp4(client, done.id, tmp_path)
        assert sound is not None and sound.sample_rate == RATE
    assert io.BytesIO(kept).getbuffer().nbytes > 0
