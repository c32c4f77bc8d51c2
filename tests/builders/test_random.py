"""Released architectures with random weights as a model source (``--model random:NAME[:tiny]``):
their published sizes, built on the meta device from the skeleton a server would load; the tiny
scale of each built, checked at start like any model and deterministic; and one served over
HTTP exactly as a user starts it."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffserve.builders import random as random_weights
from diffserve.config.flags import ConfigError, ServerConfig
from diffserve.executor.families import architectures
from server import Server, decode

ARCHITECTURES = architectures()
# Parameters of each released model's modules, in billions (its published size).
PUBLISHED = {
    "flux.1-dev": {"transformer": 11.90, "text_encoder_2": 4.76, "text_encoder": 0.123},
    "flux.1-fill-dev": {"transformer": 11.90, "text_encoder_2": 4.76, "text_encoder": 0.123},
    "qwen-image": {"transformer": 20.43, "text_encoder": 8.29},
    "z-image-turbo": {"transformer": 6.15, "text_encoder": 4.02},
    "sdxl": {"unet": 2.57, "text_encoder_2": 0.695, "text_encoder": 0.123},
    "wan2.1-14b": {"transformer": 14.29, "text_encoder": 5.68},
    "ltx-2": {"transformer": 19.0, "text_encoder": 12.20},  # LTX-2 19B, Gemma 3 12B
    "hunyuan-video-1.5": {"transformer": 8.3, "text_encoder": 7.07},  # Qwen2.5-VL-7B's text model
}


def billions(path: str, name: str) -> float:
    """The parameters of skeleton ``path``'s module ``name``, built on the meta device."""
    import torch
    import transformers

    entry = random_weights.marker(path)["modules"][name]
    with torch.device("meta"):
        if entry["library"] == "transformers":
            config = getattr(transformers, entry["config_class"]).from_pretrained(Path(path) / name)
            module = getattr(transformers, entry["class"])(config)
        else:
            cls = random_weights.diffusers_class(entry["library"], entry["class"])
            module = cls.from_config(cls.load_config(Path(path) / name))
    return sum(p.numel() for p in module.parameters()) / 1e9


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_the_published_sizes(name, tmp_path):
    path = random_weights.resolve(f"random:{name}", tmp_path)
    for module, size in PUBLISHED[name].items():
        assert billions(path, module) == pytest.approx(size, rel=0.01), module


def test_a_spec_that_names_nothing_known_is_refused_at_configuration():
    with pytest.raises(ConfigError, match=r"--model 'random:flux': no random architecture "
                                          r"'flux'; known: sdxl, flux.1-dev, flux.1-fill-dev, qwen-image"):
        ServerConfig(model="random:flux")
    with pytest.raises(ConfigError, match=r"the scale 'huge' is not one of full, tiny"):
        ServerConfig(model="random:sdxl:huge")


@pytest.fixture(scope="module")
def built():
    """Each architecture's tiny scale, built as the executor builds it (start-up checks run)."""
    from diffserve.executor.runtime import build_runtime

    return {name: build_runtime(ServerConfig(model=f"random:{name}:tiny", device="cpu",
                                             torch_threads=1))
            for name in ARCHITECTURES}


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_each_tiny_scale_serves_every_task_in_the_step_engine(built, name):
    rt = built[name]
    assert rt.info.random_weights and rt.loaded.random_weights
    assert rt.mode == "step" and rt.fallback == {} and rt.unavailable == {}
    assert rt.info.family is not None


def test_random_weights_are_the_same_at_every_build(built):
    from diffserve.executor.runtime import build_runtime

    again = build_runtime(ServerConfig(model="random:sdxl:tiny", device="cpu", torch_threads=1,
                                       skip_startup_check=True))
    for mine, theirs in zip(built["sdxl"].loaded.pipe.unet.parameters(),
                            again.loaded.pipe.unet.parameters()):
        assert (mine == theirs).all()


def test_served_over_http_as_any_model():
    with Server("--device", "cpu", "--dtype", "float32", model="random:flux.1-dev:tiny") as server:
        with server.client() as c:
            models = c.get("/v1/models").json()["data"][0]
            answer = c.post("/v1/images/generations",
                            json={"prompt": "a random cat", "num_inference_steps": 2, "n": 2})
        assert models["random_weights"] is True and models["id"] == "random:flux.1-dev:tiny"
        assert answer.status_code == 200, answer.text
        images = [decode(d["b64_json"]) for d in answer.json()["data"]]
        assert [image.shape for image in images] == [(64, 64, 3)] * 2
