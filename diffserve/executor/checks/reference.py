"""The reference oracle: a request through the plain diffusers pipeline of its task, called alone
with the server's seeds and nothing else shared. What every served image is compared with, by the
tests and the benchmarks (and what an operator can run to check a served image by hand)."""

from __future__ import annotations

import inspect

import numpy as np
import torch
from PIL import Image

from diffserve.executor.families.base import BY_AREA, IMAGE_LIST, ONE_IMAGE
from diffserve.executor.families.control_hooks import control_kwargs
from diffserve.executor.families.known import family_for
from diffserve.executor.families.outputs import to_uint8
from diffserve.executor.model.loading import FORCED_KWARGS, LoadedModel
from diffserve.executor.pipeline import built_from, guidance_on_guider, size_as_asked
from diffserve.wire.request import ImageRequest


def solo(loaded: LoadedModel, pipelines: dict, request: ImageRequest, image=None, mask=None,
         start: int = 0, stop: int | None = None, references=None, controls=None,
         sound: bool = False):
    """Images ``start``..``stop-1`` of ``request`` from one call of the plain pipeline for its task
    (``pipelines``: task name -> pipeline, the loaded one where the task is missing), with the
    seeds the server uses (image i: seed + i) and nothing else shared. ``references``: an
    instruction edit's images (fitted to the request's size), each row gets them; ``controls``:
    with the request's controls, their (control model, image) pairs: the call is then of
    diffusers' ControlNet pipeline for the task, every row with those images. ``sound``: a
    video model's sound tracks too, as (images, waveforms (k, channels, samples) float32)."""
    stop = request.n if stop is None else stop
    pipe = pipelines.get(request.task, loaded.pipe)
    family = family_for(type(loaded.pipe).__name__)
    # What the documented rules add to a plain call of an edit's pipeline (docs/edits.md,
    # "Instruction edits"): its family's ``reference_call``, where the pipeline is the family's.
    rule = family.reference_call if family and type(pipe).__name__ in family.pipelines else None
    controlled = {}
    if controls:
        pipe, controlled = controlnet_call(family, pipe, request, controls)
    accepts = set(inspect.signature(pipe.__call__).parameters)
    count = stop - start
    # The server's own keywords count (use_resolution_binning=False: the size asked for).
    kwargs = {k: v for k, v in {**loaded.call_kwargs, **FORCED_KWARGS}.items() if k in accepts}
    kwargs.update(prompt=[request.prompt] * count, output_type="np",
                  generator=[torch.Generator("cpu").manual_seed(request.seed_of(i))
                             for i in range(start, stop)],
                  num_inference_steps=request.num_inference_steps)
    guidance = family.guidance_kwarg if family else "guidance_scale"
    if guidance in accepts:  # else its guider holds it (guidance_on_guider)
        kwargs[guidance] = request.guidance_scale
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
    if rule == BY_AREA:
        kwargs["max_area"] = request.width * request.height
        if references:
            kwargs["_auto_resize"] = False
    pictures = [Image.fromarray(r) for r in references or ()]
    if rule in (ONE_IMAGE, IMAGE_LIST):
        kwargs.update(prompt=request.prompt, num_images_per_prompt=count,
                      image=pictures[0] if rule == ONE_IMAGE else pictures)
        if request.negative_prompt:
            kwargs["negative_prompt"] = request.negative_prompt
    elif pictures:
        (picture,) = pictures  # one image a row
        kwargs["image"] = [picture] * count
    kwargs.update(controlled)
    with (torch.inference_mode(), guidance_on_guider(pipe, request.guidance_scale),
          size_as_asked(pipe, request.width, request.height)):
        output = pipe(**kwargs)
    pixels = to_uint8(output.frames if request.num_frames else output.images)
    if sound:
        return pixels, output.audio.float().cpu().numpy()
    return pixels


def controlnet_call(family, pipe, request: ImageRequest, controls) -> tuple:
    """diffusers' ControlNet pipeline for ``request``'s task (``family``'s tables), built from
    ``pipe``, and the keywords of its controls: each model's one image for every row, scale,
    window and mode (several models through diffusers' multi-ControlNet)."""
    import diffusers

    modules, images = [m for m, _ in controls], [Image.fromarray(i) for _, i in controls]
    net = modules[0] if len(modules) == 1 else getattr(diffusers, family.control_multi)(modules)
    kwargs = control_kwargs(family.control_image_kwarg[request.task], request.controls, images)
    # The modules as loaded (from_pipe would cast them).
    built = built_from(pipe, family.control_pipelines[request.task], controlnet=net)
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
