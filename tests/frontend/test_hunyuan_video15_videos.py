"""HunyuanVideo 1.5 through the Videos API as the official SDK drives it, against ``diffserve
serve`` on tiny-hunyuan-video15: jobs at once share forwards, each MP4 (video alone: the model
makes no sound) shows the plain pipeline's frames; asking it for sound is a 400."""

from __future__ import annotations

import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from server import LAUNCHES, assert_openai_error, metric, serves, spec

from diffserve.executor.checks.reference import solo
from diffserve.executor.families.known import family_for
from diffserve.executor.model.loading import load_model
from diffserve.executor.model.task_pipelines import task_pipelines
from diffserve.frontend.videos.encode import decode_mp4, decode_sound, encode_mp4
from diffserve.wire.request import ImageRequest

openai = pytest.importorskip("openai")
warnings.filterwarnings("ignore", category=DeprecationWarning)  # the SDK marks Sora's API so

MODEL = "tiny-hunyuan-video15"
MIN_PSNR = 35.0


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(float) - b.astype(float)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255 ** 2 / mse)


@pytest.fixture(scope="module")
@serves(spec("--torch-threads", "1", "--video-dir", tempfile.mkdtemp(prefix="videos-hv15-"),
             model=MODEL))
def hv15(request):
    with LAUNCHES.take(request) as server:
        yield server


def test_jobs_at_once_share_forwards_and_show_the_pipelines_frames(hv15, tmp_path):
    client = openai.OpenAI(base_url=f"{hv15.url}/v1", api_key="unused", max_retries=0)
    (card,) = client.models.list().data
    assert card.model_extra["audio_sample_rate"] == 0 and card.model_extra["frame_stride"] == 2
    with hv15.client() as c:
        before = metric(c.get("/metrics").text, "diffserve_step_running_images_count")
    jobs = [dict(prompt=f"a kite {i}", seed=50 + i, steps=3 + i % 2) for i in range(4)]

    def make(job):
        return client.videos.create_and_poll(
            prompt=job["prompt"], size="32x32", poll_interval_ms=50,
            extra_body={"seed": job["seed"], "num_frames": 5, "num_inference_steps": job["steps"]})

    with ThreadPoolExecutor(4) as pool:
        videos = list(pool.map(make, jobs))
    with hv15.client() as c:
        forwards = metric(c.get("/metrics").text, "diffserve_step_running_images_count") - before
    assert forwards < sum(job["steps"] for job in jobs)  # fewer than each job alone
    loaded = load_model(MODEL, torch_threads=1)
    pipelines = task_pipelines(loaded.pipe, family_for(loaded.pipeline_class))
    for job, video in zip(jobs, videos):
        assert video.status == "completed" and video.model_extra["audio"] is False, video
        path = tmp_path / f"{video.id}.mp4"
        path.write_bytes(client.videos.download_content(video.id).read())
        assert decode_sound(path) is None
        request = ImageRequest("ref", MODEL, 32, 32, num_inference_steps=job["steps"],
                               guidance_scale=6.0, prompt=job["prompt"], seed=job["seed"],
                               num_frames=5)
        expected = solo(loaded, pipelines, request)[0]
        alone = tmp_path / f"{video.id}-alone.mp4"
        encode_mp4(expected, 24, alone)  # the pipeline's frames through the same encoder
        assert psnr(decode_mp4(path), decode_mp4(alone)) >= MIN_PSNR


@pytest.mark.parametrize("fields, param", [
    ({"prompt": "x", "audio": True}, "audio"),  # a silent model
    ({"prompt": "x", "num_frames": 4}, "num_frames"),  # breaks 2k+1
    ({"prompt": "x", "size": "40x32"}, "size"),  # off the stride of 16
])
def test_bad_input_is_a_400_naming_the_field(hv15, fields, param):
    with hv15.client() as c:
        error = assert_openai_error(c.post("/v1/videos", json=fields), 400)
        assert error["param"] == param, error
