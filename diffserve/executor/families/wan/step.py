"""Wan video models: a 3D DiT over a causal video VAE's latents (frames x height x width),
flow matching, UMT5 text. One family drives Wan 2.1 text-to-video, Wan 2.2's two experts and
Wan image-to-video; a video is one sample whose rows carry its own frames.

- **Two experts** (Wan 2.2): ``transformer`` denoises rows whose timestep is at or above the
  pipeline's ``boundary_ratio`` x the scheduler's training timesteps, ``transformer_2`` the
  rest, each with its own guidance scale (``guidance_scale_2``). Requests at different noise
  levels share a running set; a forward is split by expert, one call of each expert present.
- **Image-to-video**: the first frame's CLIP vision features (``image_embeds``) and its VAE
  latents with the mask of the known frame (``condition``, concatenated to the latents
  channel-wise) condition every row of the request, its unconditional rows too.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from diffserve.executor.families.blocks import BlockKind
from diffserve.executor.families.base import Family
from diffserve.executor.families.outputs import to_uint8
from diffserve.executor.families.patched_rows import grid_valid
from diffserve.executor.families.row_sizes import processors_swapped
from diffserve.executor.families.wan import rows
from diffserve.executor.families.conditioning import Conditioning, Encoded, Prepared

# Latent frames the decode stage decodes before it lets another job run (4 video frames each).
LATENT_FRAMES_PER_PART = 4


@dataclass
class WanConditioning(Conditioning):
    prompt_embeds: Any
    image_embeds: Any = None  # image-to-video: the first frame's vision features, per row
    condition: Any = None  # image-to-video: mask + first-frame latents, per row


class Wan(Family):
    name = "wan"
    pipelines = ("WanPipeline",)
    block_lists = {"WanTransformer3DModel": ("blocks",)}
    block_kinds = {"WanTransformerBlock": BlockKind(shared=frozenset({"rotary_emb"}))}
    begins_at_index_zero = True
    splits_by_timestep = True  # Wan 2.2: each row to the expert of its noise level
    # Videos of several sizes and frame counts in one forward (rows.py), in one grid.
    mixes_sizes = True
    mixes_in_grid = True

    def __init__(self, pipe, pipelines, call_kwargs) -> None:
        super().__init__(pipe, pipelines, call_kwargs)
        ratio = pipe.config.get("boundary_ratio")
        self.boundary = (None if ratio is None or pipe.transformer_2 is None
                         else ratio * pipe.scheduler.config.num_train_timesteps)

    @property
    def denoiser(self):
        return self.pipe.transformer

    @property
    def denoisers(self):
        return [self.pipe.transformer] + ([self.pipe.transformer_2] if self.boundary is not None
                                          else [])

    def encode(self, prompts, negatives, cfg):
        positive, negative = self.pipe.encode_prompt(
            prompts, negatives, do_classifier_free_guidance=cfg, num_videos_per_prompt=1,
            max_sequence_length=self.call_kwargs.get("max_sequence_length", 512),
            device=self.device)
        dtype = self.dtype
        return Encoded(WanConditioning(positive.to(dtype)),
                       WanConditioning(negative.to(dtype)) if cfg else None)

    def prepare(self, task, scheduler, steps, strength, width, height, generators, encoded,
                inputs, frames=0, controls=()) -> Prepared:
        """Noise in float32 (as the pipelines draw it), and for image-to-video the first frame's
        conditioning, made by the pipeline's own helpers (no control model takes a video:
        ``controls`` is always empty here)."""
        import dataclasses

        pipe, k, torch = self.pipe, len(generators), self.torch
        timesteps = self.schedule(scheduler, steps, width, height)
        if self.begins_at_index_zero:
            scheduler.set_begin_index(0)
        positive, negative = encoded.positive, encoded.negative
        channels = pipe.vae.config.z_dim
        if not task.first_frame:
            latents = pipe.prepare_latents(k, channels, height, width, frames, torch.float32,
                                           self.device, generators)
            return Prepared(timesteps, latents, positive, negative)
        from PIL import Image

        picture = Image.fromarray(inputs["image"])
        extra: dict[str, Any] = {}
        if pipe.transformer.config.image_dim is not None:
            embeds = pipe.encode_image(picture, self.device)
            extra["image_embeds"] = embeds.to(self.dtype).repeat(k, 1, 1)
        image = pipe.video_processor.preprocess(picture, height=height, width=width).to(
            self.device, dtype=torch.float32)
        latents, extra["condition"] = pipe.prepare_latents(
            image, k, channels, height, width, frames, torch.float32, self.device, generators)
        positive = dataclasses.replace(positive, **extra)
        negative = None if negative is None else dataclasses.replace(negative, **extra)
        return Prepared(timesteps, latents, positive, negative)

    def forward(self, latents, timesteps, cond, guidance, width, height, host_timesteps=None,
                sizes=None):
        """Each row through its expert: one call per expert present among the rows, decided on
        the host from ``host_timesteps`` (a read of the device's would wait for it).
        ``sizes``: rows of several sizes or frame counts (:mod:`.rows`)."""
        if sizes is not None:
            with self._rows_masked(sizes):
                return self.forward(latents, timesteps, cond, guidance, width, height,
                                    host_timesteps)
        if self.boundary is None:
            return self._call(self.pipe.transformer, latents, timesteps, cond)
        if host_timesteps is None:
            host_timesteps = timesteps.tolist()
        high = [t >= self.boundary for t in host_timesteps]
        if all(high) or not any(high):
            expert = self.pipe.transformer if all(high) else self.pipe.transformer_2
            return self._call(expert, latents, timesteps, cond)
        out = None
        for wanted, expert in ((True, self.pipe.transformer), (False, self.pipe.transformer_2)):
            rows = [i for i, h in enumerate(high) if h == wanted]
            index = self.torch.tensor(rows, device=latents.device)
            with self.row_scope.narrow(rows):  # per-row machinery follows the split
                part = self._call(expert, latents[index], timesteps[index], cond.select(index))
            if out is None:
                out = part.new_empty((latents.shape[0], *part.shape[1:]))
            out[index] = part
        return out

    def row_processors(self):
        return rows.kinds()

    def mixes_sizes_now(self) -> str | None:
        why = super().mixes_sizes_now()
        if why is None and self.pipe.config.get("expand_timesteps"):
            return "its timesteps per token"
        return why

    @contextmanager
    def _rows_masked(self, sizes):
        """Every expert's self-attention masked to each row's own cells of the padded grid."""
        patch = self.pipe.transformer.config.patch_size
        mask = self._kept(("grid", sizes.shapes), lambda: grid_valid(
            self.torch, [shape[1:] for shape in sizes.shapes], patch, self.device)[:, None, None])
        with ExitStack() as stack:
            for denoiser in self.denoisers:
                stack.enter_context(processors_swapped(
                    denoiser, rows.kinds(), lambda inner: rows.SelfMasked(inner, mask)))
            yield

    def _call(self, transformer, latents, timesteps, cond):
        x = latents if cond.condition is None else self.torch.cat([latents, cond.condition], dim=1)
        return transformer(hidden_states=x.to(self.dtype), timestep=timesteps,
                           encoder_hidden_states=cond.prompt_embeds,
                           encoder_hidden_states_image=cond.image_embeds, return_dict=False)[0]

    def guidance_scale(self, request, timestep: float) -> float:
        low_noise = self.boundary is not None and timestep < self.boundary
        if low_noise and request.guidance_scale_2 is not None:
            return request.guidance_scale_2
        return request.guidance_scale

    def decode(self, latents, width, height, task) -> np.ndarray:
        """Videos (k, frames, height, width, 3), as the pipelines decode them."""
        video = self.pipe.vae.decode(self._vae_input(latents), return_dict=False)[0]
        return self._pixels(video)

    decodes_in_parts = True

    def decode_parts(self, latents, width, height, task):
        """:meth:`decode`, LATENT_FRAMES_PER_PART latent frames a part: the VAE's causal
        decoder run frame by frame as ``AutoencoderKLWan.decode`` runs it, with a cache of its
        own (the VAE's is shared by every call). Where the VAE tiles, or hooks or a placement
        wrap its decode, one part: its own decode."""
        vae, torch = self.pipe.vae, self.torch
        counts = getattr(vae, "_cached_conv_counts", None)
        if (vae.use_tiling or counts is None or getattr(vae, "_hf_hook", None) is not None
                or "decode" in vars(vae)):  # an instance's own: tiling or placement decides per call
            return self.decode(latents, width, height, task)
        from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

        cache = [None] * counts["decoder"]
        x = vae.post_quant_conv(self._vae_input(latents))
        frames = []
        for i in range(x.shape[2]):
            frames.append(vae.decoder(x[:, :, i:i + 1], feat_cache=cache, feat_idx=[0],
                                      first_chunk=i == 0))
            if (i + 1) % LATENT_FRAMES_PER_PART == 0 and i + 1 < x.shape[2]:
                yield
        video = torch.cat(frames, 2)
        if vae.config.patch_size is not None:
            video = unpatchify(video, patch_size=vae.config.patch_size)
        return self._pixels(torch.clamp(video, min=-1.0, max=1.0))

    def _vae_input(self, latents):
        vae, torch = self.pipe.vae, self.torch
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, vae.dtype)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device,
                                                                                vae.dtype)
        return latents.to(vae.dtype) / inverse_std + mean

    def _pixels(self, video) -> np.ndarray:
        return to_uint8(self.pipe.video_processor.postprocess_video(video, output_type="np"))


class WanImageToVideo(Wan):
    name = "wan-i2v"
    mixes_sizes = False  # its first frame's conditioning rides in channels of its own size
    pipelines = ("WanImageToVideoPipeline",)
    generates = False  # its pipeline needs the first frame
    begins_at_index_zero = False  # its pipeline leaves the begin index to the scheduler


FAMILIES = (Wan, WanImageToVideo)
