"""HunyuanVideo 1.5 image-to-video through the Videos API as the official SDK drives it, against
``diffserve serve`` on tiny-hunyuan-video15-i2v: a job with an input image at a size that is
not square is served at the request's size and shows the plain image-to-video pipeline's
frames; no image, a size off the stride or a bad frame count is a 400 naming the field."""

from __future__ import annotations

import io
import tempfile
import warnings

import numpy as np
import pytest
from server import LAUNCHES, assert_openai_error, serves, spec

from diffserve.executor.checks.reference import solo
from diffserve.executor.families.known import family_for
from diffserve.executor.model.loading import load_model
from diffserve.executor.model.task_pipelines import task_pipelines
from diffserve.frontend.videos.encode import decode_mp4, decode_sound, encode_mp4
from diffserve.wire.request import ImageRequest

openai = pytest.importorskip("openai")
warnings.filterwarnings("ignore", category=DeprecationWarning)  # the SDK marks Sora's API so

MODEL = "tiny-hunyuan-video15-i2v"
MIN_PSNR = 35.0


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(float) - b.astype(float)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255 ** 2 / mse)


@pytest.fixture(scope="module")
@serves(spec("--torch-threads", "1", "--video-dir", tempfile.mkdtemp(prefix="videos-hv15i2v-"),
             model=MODEL))
def hv15(request):
    with LAUNCHES.take(request) as server:
        yield server


def test_image_to_video_through_the_sdk_is_the_pipeline_alone(hv15, tmp_path):
    from PIL import Image

    client = openai.OpenAI(base_url=f"{hv15.url}/v1", api_key="unused", max_retries=0)
    (card,) = client.models.list().data
    assert card.model_extra["task_modes"].get("image-to-video") == "step", card
    image = np.random.default_rng(3).integers(0, 256, (32, 48, 3), dtype=np.uint8)
    data = io.BytesIO()
    Image.fromarray(image).save(data, format="PNG")
    video = client.videos.create_and_poll(
        prompt="it starts here", size="48x32", poll_interval_ms=50,
        input_reference=("first.png", data.getvalue(), "image/png"),
        extra_body={"seed": 8, "num_frames": 5, "num_inference_steps": 2})
    assert video.status == "completed", video
    path = tmp_path / f"{video.id}.mp4"
    path.write_bytes(client.videos.download_content(video.id).read())
    assert decode_sound(path) is None
    frames = decode_mp4(path)
    loaded = load_model(MODEL, torch_threads=1)
    pipelines = task_pipelines(loaded.pipe, family_for(loaded.pipeline_class))
    request = ImageRequest("ref", MODEL, 48, 32, task="image-to-video", num_inference_steps=2,
                           guidance_scale=6.0, prompt="it starts here", seed=8, num_frames=5)
    expected = solo(loaded, pipelines, request, image=image)[0]
    alone = tmp_path / "alone.mp4"
    encode_mp4(expected, 24, alone)  # the pipeline's frames through the same encoder
    assert frames.shape == expected.shape == (5, 32, 48, 3)
    assert psnr(frames, decode_mp4(alone)) >= MIN_PSNR


def first_frame_url() -> dict:
    import base64

    from PIL import Image

    data = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 40, 90)).save(data, format="PNG")
    return {"image_url": "data:image/png;base64," + base64.b64encode(data.getvalue()).decode()}


@pytest.mark.parametrize("fields, param", [
    ({"prompt": "x"}, "input_reference"),  # an image-to-video model needs its first frame
    ({"prompt": "x", "size": "40x32", "input_reference": first_frame_url()}, "size"),  # stride 16
    ({"prompt": "x", "num_frames": 4, "input_reference": first_frame_url()}, "num_frames"),
])
def test_bad_input_is_a_400_naming_the_field(hv15, fields, param):
    with hv15.client() as c:
        error = assert_openai_error(c.post("/v1/videos", json=fields), 400)
        assert error["param"] == param, error
