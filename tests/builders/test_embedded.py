"""Embedded random-weight pipelines: each builds, reloads from disk as an ordinary diffusers
directory, and generates at its native size; the Stable Diffusion family, Flux and Qwen-Image also
convert to image-to-image and inpainting pipelines. Each model is built once per module, into a
temporary directory, so these tests exercise the builders as they are rather than a cached build."""

import json
import shutil

import numpy as np
import pytest
from PIL import Image

diffusers = pytest.importorskip("diffusers")
torch = pytest.importorskip("torch")

from diffserve.builders.embedded import EMBEDDED, SERVING_DEFAULTS_FILE  # noqa: E402

PIPELINE_CLASSES = {
    "sd-mid": "StableDiffusionPipeline",
    "flux-mid": "FluxPipeline",
    "tiny-sdxl": "StableDiffusionXLPipeline",
    "tiny-sd3": "StableDiffusion3Pipeline",
    "tiny-hunyuandit": "HunyuanDiTPipeline",
    "tiny-qwen-image": "QwenImagePipeline",
    "tiny-pixart-sigma": "PixArtSigmaPipeline",
    "tiny-sana": "SanaPipeline",
}
# Pipelines that would otherwise swap the requested size for one of their standard sizes.
BINNING = {"tiny-hunyuandit", "tiny-pixart-sigma", "tiny-sana"}
SEEDS = (0, 1)


@pytest.fixture(scope="module")
def load(tmp_path_factory):
    """``load(name)``: (pipeline, serving defaults) of embedded model ``name``, built on first use.

    Runs on one torch thread: these models gain nothing from more, and when other processes
    share the cores, OpenMP workers waiting on each other turn milliseconds into seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    loaded, directories = {}, []

    def load(name):
        if name not in loaded:
            directory = tmp_path_factory.mktemp(name)
            directories.append(directory)
            EMBEDDED[name][1](directory)
            pipe = diffusers.DiffusionPipeline.from_pretrained(directory, local_files_only=True)
            pipe.set_progress_bar_config(disable=True)
            loaded[name] = pipe, json.loads((directory / SERVING_DEFAULTS_FILE).read_text())
        return loaded[name]

    yield load
    torch.set_num_threads(threads)
    for directory in directories:  # sd-mid alone is 140 MB
        shutil.rmtree(directory, ignore_errors=True)


def _generate(pipe, defaults, steps=2, seeds=SEEDS, **kwargs):
    with torch.inference_mode():
        return pipe(prompt=["a red circle"] * len(seeds),
                    generator=[torch.Generator("cpu").manual_seed(s) for s in seeds],
                    num_inference_steps=steps, guidance_scale=defaults["guidance_scale"],
                    output_type="np", **defaults.get("pipeline_kwargs", {}), **kwargs).images


def test_registry_describes_every_model():
    assert set(PIPELINE_CLASSES) | {"tiny-sd", "tiny-flux"} <= set(EMBEDDED)
    assert all(description and callable(build) for description, build in EMBEDDED.values())
    assert "regression fixture" in EMBEDDED["tiny-hunyuandit"][0]


@pytest.mark.parametrize("name", sorted(PIPELINE_CLASSES))
def test_builds_reloads_and_generates_at_native_size(load, name):
    pipe, defaults = load(name)
    assert type(pipe).__name__ == PIPELINE_CLASSES[name]
    width, height = defaults["width"], defaults["height"]
    assert width % defaults["spatial_stride"] == 0 and height % defaults["spatial_stride"] == 0
    assert defaults["num_inference_steps"] == 4
    extra = {"use_resolution_binning": False} if name in BINNING else {}
    images = _generate(pipe, defaults, height=height, width=width, **extra)
    assert images.shape == (len(SEEDS), height, width, 3)
    assert np.isfinite(images).all() and not np.array_equal(images[0], images[1])


@pytest.mark.parametrize("name", ["tiny-sd", "tiny-sdxl", "tiny-sd3", "tiny-flux", "tiny-qwen-image"])
def test_converts_to_image_to_image_and_inpainting(load, name):
    pipe, defaults = load(name)
    size = defaults["width"]
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
    mask = Image.fromarray(np.pad(np.full((size // 2, size // 2), 255, np.uint8), size // 4))
    # One image per prompt: with one image for several prompts and a generator per prompt,
    # StableDiffusion3Img2ImgPipeline (diffusers 0.42) encodes empty slices and fails.
    for auto, extra, kind in ((diffusers.AutoPipelineForImage2Image, {}, "Img2Img"),
                              (diffusers.AutoPipelineForInpainting,
                               {"mask_image": [mask] * len(SEEDS)}, "Inpaint")):
        task_pipe = auto.from_pipe(pipe)
        task_pipe.set_progress_bar_config(disable=True)
        assert kind in type(task_pipe).__name__
        # Strength below 1: the input image is encoded, partly noised, then denoised.
        images = _generate(task_pipe, defaults, image=[image] * len(SEEDS), strength=0.75,
                           height=size, width=size, **extra)
        assert images.shape == (len(SEEDS), size, size, 3)


def test_hunyuandit_turns_64x64_into_1024x1024_unless_binning_is_off(load):
    pipe, defaults = load("tiny-hunyuandit")
    assert (defaults["width"], defaults["height"]) == (64, 64)
    off = _generate(pipe, defaults, steps=1, seeds=(0,), height=64, width=64,
                    use_resolution_binning=False)
    assert off.shape == (1, 64, 64, 3)
    # The default: the size is replaced by the nearest standard one (about 2 s on a CPU).
    on = _generate(pipe, defaults, steps=1, seeds=(0,), height=64, width=64)
    assert on.shape == (1, 1024, 1024, 3)


@pytest.mark.parametrize("name", ["tiny-qwen-image", "tiny-pixart-sigma", "tiny-sana"])
def test_prompts_of_different_lengths_batch_like_single_runs(load, name):
    """Shorter prompts are padded (Qwen-Image to the longest, the others to a fixed length) and
    masked, so a batch gives each prompt the image it gets alone, with guidance too."""
    pipe, defaults = load(name)
    prompts = ["a red circle", "a small blue square on a plain white background"]
    negatives = ["", "blurry, dark"]
    guidance = {"true_cfg_scale": 4.0} if name == "tiny-qwen-image" else {}
    extra = {"use_resolution_binning": False} if name in BINNING else {}

    def run(indices):
        with torch.inference_mode():
            return pipe(prompt=[prompts[i] for i in indices],
                        negative_prompt=[negatives[i] for i in indices],
                        generator=[torch.Generator("cpu").manual_seed(i) for i in indices],
                        num_inference_steps=2, height=32, width=64, output_type="np",
                        guidance_scale=defaults["guidance_scale"], **guidance, **extra,
                        **defaults.get("pipeline_kwargs", {})).images

    batched = run([0, 1])
    alone = np.concatenate([run([0]), run([1])])
    assert batched.shape == (2, 32, 64, 3)
    assert np.abs(batched - alone).max() <= 2 / 255


def test_qwen_image_template_drops_exactly_what_precedes_the_prompt(load):
    """QwenImagePipeline drops a fixed number of leading template tokens: with the embedded
    tokenizer, as with Qwen's own, they must be all of the template before the prompt."""
    pipe, _ = load("tiny-qwen-image")
    system = pipe.prompt_template_encode.split("{}")[0]
    assert len(pipe.tokenizer(system).input_ids) == pipe.prompt_template_encode_start_idx


@pytest.mark.parametrize("name", ["tiny-pixart-sigma", "tiny-sana"])
def test_has_no_image_to_image_or_inpainting_pipeline(load, name):
    pipe, _ = load(name)
    for auto in (diffusers.AutoPipelineForImage2Image, diffusers.AutoPipelineForInpainting):
        with pytest.raises(ValueError):
            auto.from_pipe(pipe)
