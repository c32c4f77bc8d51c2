"""The reference oracle: a request through the plain diffusers pipeline of its task, called alone
with the server's seeds and nothing else shared. What every served image is compared with, by the
tests and the benchmarks (and what an operator can run to check a served image by hand)."""

from __future__ import annotations

import inspect

import numpy as np
import torch
from PIL import Image

from diffserve.executor.families import family_for
from diffserve.executor.families.outputs import to_uint8
from diffserve.executor.model.loading import FORCED_KWARGS, LoadedModel
from diffserve.executor.pipeline import built_from
from diffserve.work import ImageRequest


# What the documented rules add to a plain call of these pipelines (docs/edits.md, "Instruction edits"):
# the size asked for, and an input image taken as it is (the server fits it to that size).
SIZE_BY_AREA = {"FluxKontextPipeline"}
# Pipelines called for one prompt with the request's images: as one image, or as a list.
ONE_PROMPT = {"QwenImageEditPipeline": "single", "QwenImageEditPlusPipeline": "list"}
# diffusers' ControlNet pipeline of each (pipeline, task), the keyword of its control images,
# and the class that stacks several control models.
CONTROLNET = {
    ("StableDiffusionPipeline", "generate"): ("StableDiffusionControlNetPipeline", "image"),
    ("StableDiffusionPipeline", "image-to-image"): ("StableDiffusionControlNetImg2ImgPipeline",
                                                    "control_image"),
    ("StableDiffusionPipeline", "inpaint"): ("StableDiffusionControlNetInpaintPipeline",
                                             "control_image"),
    ("StableDiffusionXLPipeline", "generate"): ("StableDiffusionXLControlNetPipeline", "image"),
    ("StableDiffusionXLPipeline", "image-to-image"): ("StableDiffusionXLControlNetImg2ImgPipeline",
                                                      "control_image"),
    ("StableDiffusionXLPipeline", "inpaint"): ("StableDiffusionXLControlNetInpaintPipeline",
                                               "control_image"),
    ("FluxPipeline", "generate"): ("FluxControlNetPipeline", "control_image"),
    ("FluxPipeline", "image-to-image"): ("FluxControlNetImg2ImgPipeline", "control_image"),
    ("FluxPipeline", "inpaint"): ("FluxControlNetInpaintPipeline", "control_image"),
    ("QwenImagePipeline", "generate"): ("QwenImageControlNetPipeline", "control_image"),
}
MULTI_CONTROLNET = {"ControlNetModel": "MultiControlNetModel",
                    "FluxControlNetModel": "FluxMultiControlNetModel",
                    "QwenImageControlNetModel": "QwenImageMultiControlNetModel"}


def solo(loaded: LoadedModel, pipelines: dict, request: ImageRequest, image=None, mask=None,
         start: int = 0, stop: int | None = None, references=None, controls=None) -> np.ndarray:
    """Images ``start``..``stop-1`` of ``request`` from one call of the plain pipeline for its task
    (``pipelines``: task name -> pipeline, the loaded one where the task is missing), with the
    seeds the server uses (image i: seed + i) and nothing else shared. ``references``: an
    instruction edit's images (fitted to the request's size), each row gets them; ``controls``:
    with the request's controls, their (control model, image) pairs: the call is then of
    diffusers' ControlNet pipeline for the task, every row with those images."""
    stop = request.n if stop is None else stop
    pipe = pipelines.get(request.task, loaded.pipe)
    control_kwargs = {}
    if controls:
        pipe, control_kwargs = controlnet_call(loaded, pipe, request, controls)
    accepts = set(inspect.signature(pipe.__call__).parameters)
    count = stop - start
    # The server's own keywords count (use_resolution_binning=False: the size asked for).
    kwargs = {k: v for k, v in {**loaded.call_kwargs, **FORCED_KWARGS}.items() if k in accepts}
    family = family_for(type(loaded.pipe).__name__)
    kwargs.update(prompt=[request.prompt] * count, output_type="np",
                  generator=[torch.Generator("cpu").manual_seed(request.seed_of(i))
                             for i in range(start, stop)],
                  num_inference_steps=request.num_inference_steps,
                  **{family.guidance_kwarg if family else "guidance_scale": request.guidance_scale})
    if "height" in accepts:
        kwargs.update(height=request.height, width=request.width)
    if request.negative_prompt:
        kwargs["negative_prompt"] = [request.negative_prompt] * count
    if request.num_frames:
        kwargs["num_frames"] = request.num_frames
        if request.guidance_scale_2 is not None:
            kwargs["guidance_scale_2"] = request.guidance_scale_2
    if request.task_spec.first_frame:
        kwargs["image"] = Image.fromarray(image)
    if request.task_spec.from_image:
        kwargs.update(image=[Image.fromarray(image)] * count, strength=request.strength)
    if request.task_spec.masked:
        kwargs["mask_image"] = [Image.fromarray(mask)] * count
    if type(pipe).__name__ in SIZE_BY_AREA:
        kwargs["max_area"] = request.width * request.height
        if references:
            kwargs["_auto_resize"] = False
    pictures = [Image.fromarray(r) for r in references or ()]
    if type(pipe).__name__ in ONE_PROMPT:
        kwargs.update(prompt=request.prompt, num_images_per_prompt=count,
                      image=pictures[0] if ONE_PROMPT[type(pipe).__name__] == "single" else pictures)
        if request.negative_prompt:
            kwargs["negative_prompt"] = request.negative_prompt
    elif pictures:
        (picture,) = pictures  # one image a row
        kwargs["image"] = [picture] * count
    kwargs.update(control_kwargs)
    with torch.inference_mode():
        output = pipe(**kwargs)
    return to_uint8(output.frames if request.num_frames else output.images)


def controlnet_call(loaded: LoadedModel, pipe, request: ImageRequest, controls) -> tuple:
    """diffusers' ControlNet pipeline for ``request``'s task, built from ``pipe``, and the
    keywords of its controls: each model's one image for every row, scale, window and mode
    (several models through diffusers' multi-ControlNet)."""
    import diffusers

    cls, keyword = CONTROLNET[(type(loaded.pipe).__name__, request.task)]
    modules, images = [m for m, _ in controls], [Image.fromarray(i) for _, i in controls]
    one = len(modules) == 1
    net = modules[0] if one else getattr(diffusers, MULTI_CONTROLNET[type(modules[0]).__name__])(modules)
    pick = (lambda values: values[0]) if one else list  # noqa: E731
    spec = request.controls
    kwargs = {keyword: pick(images), "controlnet_conditioning_scale": pick([c.scale for c in spec]),
              "control_guidance_start": pick([c.start for c in spec]),
              "control_guidance_end": pick([c.end for c in spec])}
    if any(c.mode is not None for c in spec):
        kwargs["control_mode"] = pick([c.mode for c in spec])
    built = built_from(pipe, cls, controlnet=net)  # the modules as loaded (from_pipe casts them)
    built.set_progress_bar_config(disable=True)
    return built, kwargs


def max_diff(a: np.ndarray, b: np.ndarray) -> int:
    assert a.shape == b.shape, (a.shape, b.shape)
    return int(np.abs(a.astype(int) - b.astype(int)).max())


def sample_image(size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """An input image with some structure, and a mask of its right half."""
    rng = np.random.default_rng(seed)
    image = (rng.random((size, size, 3)) * 255).astype(np.uint8)
    image[size // 4:3 * size // 4, size // 4:3 * size // 4] = [200, 40, 30]
    mask = np.zeros((size, size), np.uint8)
    mask[:, size // 2:] = 255
    return image, mask


def with_adapters(pipe, loras):
    """``pipe`` (adapters loaded with load_lora_weights under their served names) set to apply
    ``loras`` [(name, scale)] the plain diffusers way, or none of them."""
    if loras:
        pipe.enable_lora()
        pipe.set_adapters([name for name, _ in loras], adapter_weights=[scale for _, scale in loras])
    else:
        pipe.disable_lora()
    return pipe
