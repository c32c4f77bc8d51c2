"""What a pipeline family gives the step engine, built from the pipeline's own components.

The step engine (:mod:`diffserve.executor.step.engine`) runs one loop for every family: admit,
one batched denoiser forward, each request's own scheduler step, retire. :class:`Family` holds
the steps every family takes in the same order (a request's schedule, its first latents for each
task, the inpainting blend, decoding), and a family overrides only what differs: how prompts are
encoded into its :class:`Conditioning`, what its denoiser takes, and the one call of its own
pipeline's helper where each pipeline's signature differs.

Preparation calls the pipelines' own helpers (``prepare_latents``, ``get_timesteps``,
``prepare_mask_latents``...) with the request's own scheduler swapped in for the duration of the
call, because those helpers read ``self.scheduler`` (``init_noise_sigma``, ``add_noise``, the begin
index): with the shared scheduler they would see another request's timesteps.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections import OrderedDict
from contextlib import nullcontext
from typing import Any, ClassVar

import numpy as np

from diffserve.wire.costs import ABOVE_ONE, uses_cfg
from diffserve.executor.families.blocks import BlockKind
from diffserve.executor.families.conditioning import Blend, Conditioning, Encoded, Prepared
from diffserve.executor.families.control_hooks import ControlHooks
from diffserve.executor.families.size_hooks import SizeHooks
from diffserve.executor.families.outputs import to_uint8
from diffserve.executor.families.schedulers import scheduler_swapped
from diffserve.executor.model.samplers import build as build_sampler
from diffserve.executor.rows import RowScope
from diffserve.wire.samples import CONTROLS
from diffserve.wire.tasks import Task


BY_MODEL, BY_ROW, SHARED = "by-model", "by-row", "shared"
# Values a family keeps per size or mix of sizes (each a few kB): enough for those in flight.
KEPT = 16
# How the reference oracle (diffserve.executor.checks.reference) calls an edit's own pipeline, as
# the documented rules add to a plain call (docs/edits.md): the size asked for as an area with
# the input image taken as it is (BY_AREA); one prompt with the request's images as one image
# (ONE_IMAGE) or as a list (IMAGE_LIST).
BY_AREA, ONE_IMAGE, IMAGE_LIST = "by-area", "one-image", "image-list"


class Family(ControlHooks, SizeHooks):
    name: ClassVar[str]
    pipelines: ClassVar[tuple[str, ...]]  # text-to-image pipeline classes this family drives
    # The dtype its weights are published in: --dtype auto's choice on a GPU
    # (diffserve.executor.model.dtypes).
    published_dtype: ClassVar[str] = "bfloat16"
    # Whether the family's own text-to-image pipeline sets the scheduler's begin index to 0 (it
    # decides the first step only for schedules whose first timestep repeats).
    begins_at_index_zero: ClassVar[bool] = False
    # The pipeline keyword the request's guidance_scale is (Qwen-Image: true_cfg_scale).
    guidance_kwarg: ClassVar[str] = "guidance_scale"
    # When classifier-free guidance runs (diffserve.wire.costs.GUIDANCE_RULES): with a scale above 1
    # (most), only with a negative prompt too (Qwen-Image), or never (guidance as an input: Flux).
    guidance_rule: ClassVar[str] = ABOVE_ONE
    # Instruction edits (diffserve.wire.tasks.EDIT): the most reference images one takes (0: none),
    # whether the prompt's encoding sees them (a vision-language text encoder), and whether the
    # family's pipeline generates without one.
    max_references: ClassVar[int] = 0
    encodes_references: ClassVar[bool] = False
    reference_call: ClassVar[str | None] = None  # BY_AREA, ONE_IMAGE or IMAGE_LIST
    # The tasks that redraw an input image by strength which the family runs, each with the
    # diffusers pipeline built from the loaded one's components: what diffusers' auto-pipelines
    # pick (a test pins it), named here so that a start imports those pipelines alone, not every
    # pipeline the auto-pipelines know (a second of CPU an executor start).
    strength_pipelines: ClassVar[dict[str, str]] = {}
    # The denoiser's repeated blocks, for the step cache and --compile (executor/blocks.py): its
    # class name -> the attributes that hold its block lists, in the order its forward runs
    # them; and each block class's calling convention. Empty: neither accelerator knows it (a
    # UNet's blocks are known by their structure, for every family that has one).
    block_lists: ClassVar[dict[str, tuple[str, ...]]] = {}
    block_kinds: ClassVar[dict[str, BlockKind]] = {}
    # The multiple its prompts' token lengths are padded to (masked) where --compile needs static
    # shapes, so that each length is not a graph of its own; 0 where its lengths are fixed
    # (PixArt's 300) or its denoiser pads them itself (Z-Image's 32).
    text_bucket: ClassVar[int] = 0
    # Whether its forward sends rows to different denoisers by their timestep (Wan 2.2's
    # experts): it is then given the rows' timesteps on the host too.
    splits_by_timestep: ClassVar[bool] = False
    # Whether the pipeline takes one reference image per prompt row (edits of several requests
    # then share a call in request mode); else one list of references for the whole call.
    references_per_row: ClassVar[bool] = True
    generates: ClassVar[bool] = True
    # The pipeline (built over the loaded one's components) that serves image-to-video for a
    # family whose loaded pipeline makes videos from text (LTX-2); None: the loaded one's own.
    first_frame_pipeline: ClassVar[str | None] = None
    # The schedule's shift from the image's token count, where the scheduler shifts dynamically:
    # the default of ``max_shift`` the family's own pipeline passes when the scheduler's config
    # has none (SD3's differs from Flux's).
    max_shift: ClassVar[float] = 1.15
    def __init__(self, pipe, pipelines: dict[str, Any], call_kwargs: dict[str, Any]) -> None:
        import torch

        self.torch = torch
        self.pipe = pipe
        self.pipelines = pipelines  # task name -> its pipeline (edits: built with from_pipe)
        self.call_kwargs = call_kwargs
        self.device = pipe._execution_device
        self._samplers: dict[str, Any] = {}  # name -> a scheduler to copy per request
        self.row_scope = RowScope()  # narrowed where a forward splits between denoisers
        self._kept_values: OrderedDict[tuple, Any] = OrderedDict()
        # The step loop and an encode stage both ask; reentrant: a mix of sizes makes its
        # sizes' values within its own.
        self._kept_lock = threading.RLock()

    def _kept(self, key: tuple, make):
        """``make()`` once while ``key`` is in use: a size's position ids, a mix of sizes'
        positions and masks (built on the host and copied up, they would cost a copy that
        waits for the device at every forward)."""
        key = (*key, self.dtype)
        with self._kept_lock:
            if key not in self._kept_values:
                self._kept_values[key] = make()
                while len(self._kept_values) > KEPT:
                    self._kept_values.popitem(last=False)
            self._kept_values.move_to_end(key)
            return self._kept_values[key]

    @property
    def denoiser(self):
        return getattr(self.pipe, "unet", None) or self.pipe.transformer

    @property
    def dtype(self):
        """The denoiser's dtype now (the start-up check may run the model in float32 a while)."""
        return self.denoiser.dtype

    # -- per admission ---------------------------------------------------------------------

    def new_scheduler(self, name: str = ""):
        """A request's own scheduler: a copy of the pipeline's, or of sampler ``name`` over its
        config (:mod:`diffserve.executor.model.samplers`)."""
        if not name:
            return copy.deepcopy(self.pipe.scheduler)
        if name not in self._samplers:
            self._samplers[name] = build_sampler(self.pipe.scheduler, name)
        return copy.deepcopy(self._samplers[name])

    @classmethod
    def uses_cfg(cls, guidance_scale: float, negative_prompt: str) -> bool:
        """Whether the family's own pipeline runs classifier-free guidance for these settings."""
        return uses_cfg(cls.guidance_rule, guidance_scale, negative_prompt)

    def encode(self, prompts: list[str], negatives: list[str] | None, cfg: bool,
               references: list[list[np.ndarray]] | None = None) -> Encoded:
        """One call of the pipeline's ``encode_prompt`` for several prompts. ``negatives`` is None
        where the pipeline would get no negative prompt (which some families treat differently
        from an empty one). ``references``: each prompt's reference images, given only to a
        family that ``encodes_references`` (and None for prompts of generations)."""
        raise NotImplementedError

    def prepare(self, task: Task, scheduler, steps: int, strength: float, width: int, height: int,
                generators: list, encoded: Encoded, inputs: dict[str, np.ndarray],
                frames: int = 0, controls: tuple = ()) -> Prepared:
        """A request's schedule and first latents, in the order of the family's own pipelines:
        generation starts from noise; image-to-image from the input image noised to the first
        timestep ``strength`` leaves; inpainting also keeps what each step blends back in.
        ``frames``: a video's frame count (video families; 0 for an image); ``controls``: the
        request's ControlNet controls, whose images ``inputs`` holds."""
        k, dtype = len(generators), encoded.positive.dtype
        # The control images first: the ControlNet pipelines prepare them (sampling the VAE's
        # latents with the request's generators, where they encode them) before the latents.
        controls = [(c, self.control_condition(self.controls[c.model].module, image, width,
                                               height, k, dtype, generators))
                    for c, image in zip(controls, inputs.get(CONTROLS, []))]
        positive, negative = self.request_conditioning(task, width, height, encoded)
        if task.references:  # their tokens join every row of the request, its CFG rows too
            extra = self.reference_conditioning(inputs["references"], width, height, k, dtype,
                                                generators)
            positive = dataclasses.replace(positive, **extra)
            negative = None if negative is None else dataclasses.replace(negative, **extra)
        if not task.from_image:
            timesteps = self.schedule(scheduler, steps, width, height)
            if self.begins_at_index_zero:
                scheduler.set_begin_index(0)
            with scheduler_swapped(self.pipe, scheduler):
                latents = self.noise_latents(k, width, height, dtype, generators)
                return Prepared(timesteps, latents, positive, negative,
                                self.step_kwargs(self.pipe, generators), controls=controls)
        pipe = self.pipelines[task.name]
        init = self.image_tensor(pipe, inputs["image"], width, height).repeat(k, 1, 1, 1)
        with scheduler_swapped(pipe, scheduler):
            timesteps = self.edit_schedule(pipe, scheduler, steps, strength, width, height)
            start = timesteps[:1].repeat(k)
            step_kwargs = self.step_kwargs(pipe, generators)
            if not task.masked:
                latents = self.image_latents(pipe, init, start, k, width, height, dtype, generators)
                return Prepared(timesteps, latents, positive, negative, step_kwargs,
                                controls=controls)
            latents, noise, image_latents = self.inpaint_latents(
                pipe, init, start, strength == 1.0, k, width, height, dtype, generators)
            condition = self.mask_tensor(pipe, inputs["mask_image"], width, height).repeat(k, 1, 1, 1)
            mask = self.mask_latents(pipe, condition, init * (condition < 0.5), k, width, height,
                                     dtype, generators)
            return Prepared(timesteps, latents, positive, negative, step_kwargs,
                            Blend(mask, image_latents, noise), controls)

    def request_conditioning(self, task: Task, width: int, height: int,
                             encoded: Encoded) -> tuple[Conditioning, Conditioning | None]:
        """The prompt's conditioning plus what the family adds per request (SDXL: size ids)."""
        return encoded.positive, encoded.negative

    def references_together(self, requests: list[tuple[list, int, int]], dtype):
        """A context within which the reference images of ``requests`` ((images, width, height)
        each) are encoded already, together where the family can
        (:mod:`~diffserve.executor.families.reference_batch`); here, nothing is."""
        return nullcontext()

    def reference_conditioning(self, references: list[np.ndarray], width: int, height: int,
                               k: int, dtype, generators: list) -> dict[str, Any]:
        """Instruction edits (families with ``max_references``): the fields a request's reference
        images (uint8, height x width x 3, fitted to the output size) add to its conditioning,
        ``k`` rows each, as its pipeline encodes them."""
        raise NotImplementedError(f"{self.name} does not condition on reference images")

    def request_kwargs(self, task: Task, width: int, height: int,
                       references: list[list] | None = None) -> dict[str, Any]:
        """Request mode: what a call of this family's pipeline needs beyond the common keywords
        for ``task`` at this size. ``references``: an edit's images (PIL), each row's own list;
        where the pipeline takes one list for all rows (``references_per_row`` False), the call
        holds one request's rows, which share it."""
        if not references:
            return {}
        return {"image": [refs[0] for refs in references] if self.references_per_row
                else references[0]}

    # The one call of the family's pipeline helper for each start; signatures differ per family.

    def noise_latents(self, k: int, width: int, height: int, dtype, generators: list):
        raise NotImplementedError

    # The edit helpers below are the signatures diffusers' SD-style edit pipelines share (SD,
    # SDXL, SD3); families whose edit pipelines differ (Flux, Qwen-Image) override them.

    def image_latents(self, pipe, init, start, k: int, width: int, height: int, dtype,
                      generators: list):
        return pipe.prepare_latents(init, start, k, 1, dtype, self.device, generators)

    def inpaint_latents(self, pipe, init, start, full_strength: bool, k: int, width: int,
                        height: int, dtype, generators: list):
        """(latents, noise, image_latents) of an inpainting request."""
        return pipe.prepare_latents(
            k, pipe.vae.config.latent_channels, height, width, dtype, self.device, generators,
            None, image=init, timestep=start, is_strength_max=full_strength, return_noise=True,
            return_image_latents=True)

    def mask_latents(self, pipe, condition, masked_image, k: int, width: int, height: int, dtype,
                     generators: list):
        raise NotImplementedError

    def step_kwargs(self, pipe, generators: list) -> dict[str, Any]:
        """Extra keywords of every scheduler step (eta and the generators, where it takes them)."""
        prepare = getattr(pipe, "prepare_extra_step_kwargs", None)
        return prepare(generators, 0.0) if prepare else {}

    def schedule(self, scheduler, steps: int, width: int, height: int):
        """A request's whole noise schedule, set on its own scheduler as the family's
        text-to-image pipeline sets it (families with shifted schedules override this)."""
        from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import retrieve_timesteps

        return retrieve_timesteps(scheduler, steps, self.device)[0]

    def shift(self, scheduler, width: int, height: int, patch: int):
        """``mu``, the schedule's shift for an image of this size (``patch`` x ``patch`` latent
        cells a token), by the rule the flow-matching pipelines share."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        config, scale = scheduler.config, self.pipe.vae_scale_factor
        seq_len = (height // scale // patch) * (width // scale // patch)
        return calculate_shift(seq_len, config.get("base_image_seq_len", 256),
                               config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                               config.get("max_shift", self.max_shift))

    def edit_schedule(self, pipe, scheduler, steps: int, strength: float, width: int, height: int):
        """An edit's schedule: the whole one, cut by ``strength`` by the edit pipeline's own
        ``get_timesteps`` (which also sets the scheduler's begin index). Call it with the
        request's scheduler swapped into ``pipe``."""
        self.schedule(scheduler, steps, width, height)
        timesteps, remaining = pipe.get_timesteps(steps, strength, self.device)
        if remaining < 1:
            raise ValueError(f"strength {strength} leaves no denoising step of {steps}")
        return timesteps

    # -- per step --------------------------------------------------------------------------

    def forward(self, latents, timesteps, cond: Conditioning, guidance, width: int,
                height: int) -> Any:
        """One denoiser forward over stacked rows: ``timesteps`` and ``guidance`` have one
        value per row, ``cond`` one row per row of ``latents``; every row has this size. A
        family that ``splits_by_timestep`` is also given ``host_timesteps``, the rows'
        timesteps on the host, to split by without reading the device. A family that
        ``mixes_sizes`` is given ``sizes`` (a :class:`~.row_sizes.RowSizes`) where the rows'
        sizes differ: ``latents`` are then padded to the longest row's tokens, and so is the
        output."""
        raise NotImplementedError

    def guide(self, uncond, cond, scale: float):
        """Classifier-free guidance of one request's rows."""
        return uncond + scale * (cond - uncond)

    @property
    def denoisers(self) -> list:
        """Every denoiser a forward may call (Wan 2.2 has two experts)."""
        return [self.denoiser]

    def cache_tokens(self, width: int, height: int) -> int | None:
        """The step cache's tokens: the leading tokens of the denoiser's hidden states that an
        image's signal and cache cover (None: all of them; a family whose hidden states also
        carry tokens padded across the forward names its image tokens)."""
        return None

    def guidance_scale(self, request, timestep) -> float:
        """The guidance scale of ``request``'s step at ``timestep`` (two-expert models switch
        it with the expert)."""
        return request.guidance_scale

    def denoise_step(self, scheduler, prediction, timestep, latents, step_kwargs: dict[str, Any]):
        """A request's own scheduler step from ``timestep``: its next latents."""
        return scheduler.step(prediction, timestep, latents, **step_kwargs, return_dict=False)[0]

    def blend(self, scheduler, blend: Blend, latents, next_timestep):
        """Inpainting: outside the mask, the input at the noise level of ``next_timestep`` (None
        after the last step: the input itself)."""
        proper = blend.image_latents
        if next_timestep is not None:
            proper = self.renoise(scheduler, proper, blend.noise, next_timestep)
        return (1 - blend.mask) * proper + blend.mask * latents

    def renoise(self, scheduler, image_latents, noise, timestep) -> Any:
        """The input's latents at the noise level of ``timestep``, by the scheduler's own rule
        (flow-matching schedulers interpolate, ``scale_noise``; the others ``add_noise``)."""
        t = self.torch.tensor([timestep])
        if hasattr(scheduler, "scale_noise"):
            return scheduler.scale_noise(image_latents, t, noise)
        return scheduler.add_noise(image_latents, noise, t)

    # -- at the end ------------------------------------------------------------------------

    def decode(self, latents, width: int, height: int, task: Task) -> np.ndarray:
        """Latents of finished samples to uint8 pixels (k, height, width, 3), as the pipeline of
        ``task`` decodes them."""
        latents = self.vae_latents(self.unpack(latents, width, height), task)
        return self.postprocess(self.vae_decode(latents))

    decodes_in_parts: ClassVar[bool] = False  # whether decode_parts yields between parts

    def decode_parts(self, latents, width: int, height: int, task: Task):
        """:meth:`decode` as a generator that yields between its parts and returns its pixels:
        the decode stage runs other jobs between two parts. One part here; a video family
        decodes a few latent frames a part, so that a long video does not hold up the finish
        of a short one."""
        return self.decode(latents, width, height, task)
        yield  # noqa: unreachable - a generator of one part

    def unpack(self, latents, width: int, height: int):
        """Latents as the VAE takes them (families that pack latents into tokens unpack here)."""
        return latents

    def image_latents_of(self, latents, width: int, height: int):
        """Latents as an image's [k, C, h, w] (the layout a rollout returns them in)."""
        return self.unpack(latents, width, height)

    def vae_latents(self, latents, task: Task):
        """The denoiser's latents in the VAE's own scale."""
        return latents / self.pipe.vae.config.scaling_factor

    def vae_decode(self, latents):
        return self.pipe.vae.decode(latents, return_dict=False)[0]

    def postprocess(self, image) -> np.ndarray:
        # Denormalised on the device and made uint8 there: a quarter of float32's bytes cross
        # to the host, and the host does not convert them.
        pixels = self.pipe.image_processor.postprocess(
            image, output_type="pt", do_denormalize=[True] * image.shape[0])
        return to_uint8(pixels.permute(0, 2, 3, 1))

    # -- shared helpers --------------------------------------------------------------------

    def image_tensor(self, pipe, image: np.ndarray, width: int, height: int):
        """An input frame (uint8, height x width x 3) as the pipeline would preprocess it."""
        from PIL import Image

        tensor = pipe.image_processor.preprocess(Image.fromarray(image), height=height, width=width)
        return tensor.to(dtype=self.torch.float32)

    def mask_tensor(self, pipe, mask: np.ndarray, width: int, height: int):
        from PIL import Image

        return pipe.mask_processor.preprocess(Image.fromarray(mask), height=height, width=width)
