"""HunyuanVideo 1.5: a 3D DiT over a video VAE's latents; each prompt through Qwen2.5-VL (its
hidden states two layers before the last, the chat template's leading tokens dropped) and,
for text in quotes, ByT5; flow matching (Euler, a fixed shift) over evenly spaced sigmas.

- **Guidance**: the pipeline guides through its ``guider`` (classifier-free guidance, whose
  scale the guider holds rather than the call): here each request's own scale, by the same
  rule (uncond + scale x (cond - uncond)), and against the empty prompt where it has no
  negative one, as the pipeline encodes it.
- **Text-to-video inputs**: the denoiser takes the latents with a condition and a mask
  concatenated channel-wise, and vision tokens; for text-to-video all three are zeros, made in
  the forward for its rows.
- **Sizes**: the rows of one forward share a size and frame count (request shapes): each size
  and length is a running set of its own, as for Wan.
- **Image-to-video** (``HunyuanVideo15ImageToVideoPipeline``, its own checkpoint with a SigLIP
  image encoder): the condition channels hold the input image's latents in the first latent
  frame (mask 1 there), and the vision tokens its SigLIP features, each made by the pipeline's
  own helpers at the request's size. The pipeline picks its size from the image's aspect and
  its ``target_size``, a rule that misses many sizes on the stride; the served size is the
  request's (the server fits the image to it) and the reference calls the pipeline with its
  size pick made the request's (``size_as_asked``; docs/videos.md). The DiT decides text-to-video for the
  whole batch (all image features zero), so the two tasks' rows never share a forward; the
  image-to-video model serves image-to-video only, as Wan's does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from diffserve.executor.families.base import Family
from diffserve.executor.families.conditioning import Conditioning, Encoded, Prepared
from diffserve.executor.families.outputs import to_uint8


@dataclass
class HunyuanVideo15Conditioning(Conditioning):
    prompt_embeds: Any  # Qwen2.5-VL's
    prompt_mask: Any
    glyph_embeds: Any  # ByT5's, zeros where the prompt quotes no text
    glyph_mask: Any
    image_embeds: Any = None  # image-to-video: the input image's SigLIP features, per row
    condition: Any = None  # image-to-video: the first frame's latents then its mask, per row


class HunyuanVideo15(Family):
    name = "hunyuan-video15"
    pipelines = ("HunyuanVideo15Pipeline",)

    def encode(self, prompts, negatives, cfg):
        def encoded(texts):
            embeds, mask, glyphs, glyph_mask = self.pipe.encode_prompt(
                texts, device=self.device, dtype=self.dtype, batch_size=len(texts))
            return HunyuanVideo15Conditioning(embeds, mask, glyphs, glyph_mask)

        return Encoded(encoded(prompts),
                       encoded(negatives or [""] * len(prompts)) if cfg else None)

    def schedule(self, scheduler, steps, width, height):
        from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import (
            retrieve_timesteps,
        )

        sigmas = np.linspace(1.0, 0.0, steps + 1)[:-1]
        return retrieve_timesteps(scheduler, steps, self.device, sigmas=sigmas)[0]

    def prepare(self, task, scheduler, steps, strength, width, height, generators, encoded,
                inputs, frames=0, controls=()) -> Prepared:
        """Noise in the denoiser's dtype, as the pipeline draws it."""
        pipe = self.pipe
        timesteps = self.schedule(scheduler, steps, width, height)
        latents = pipe.prepare_latents(len(generators), pipe.num_channels_latents, height, width,
                                       frames, self.dtype, self.device, generators)
        if not task.first_frame:
            return Prepared(timesteps, latents, encoded.positive, encoded.negative)
        from PIL import Image

        picture = Image.fromarray(inputs["image"])
        embeds = pipe.encode_image(picture, len(generators), self.device, self.dtype)
        condition, mask = pipe.prepare_cond_latents_and_mask(
            latents, picture, len(generators), height, width, self.dtype, self.device)
        extra = {"image_embeds": embeds, "condition": self.torch.cat([condition, mask], dim=1)}
        positive = dataclasses.replace(encoded.positive, **extra)
        negative = (None if encoded.negative is None
                    else dataclasses.replace(encoded.negative, **extra))
        return Prepared(timesteps, latents, positive, negative)

    def forward(self, latents, timesteps, cond, guidance, width, height):
        pipe, torch, dtype = self.pipe, self.torch, self.dtype
        x = latents.to(dtype)
        if cond.condition is not None:  # image-to-video
            condition, vision = cond.condition.to(dtype), cond.image_embeds
        else:
            condition = torch.cat(pipe.prepare_cond_latents_and_mask(x, dtype, x.device), dim=1)
            vision = torch.zeros(x.shape[0], pipe.vision_num_semantic_tokens,
                                 pipe.vision_states_dim, dtype=dtype, device=x.device)
        return pipe.transformer(
            hidden_states=torch.cat([x, condition], dim=1), image_embeds=vision,
            timestep=timesteps.to(dtype), encoder_hidden_states=cond.prompt_embeds,
            encoder_attention_mask=cond.prompt_mask, encoder_hidden_states_2=cond.glyph_embeds,
            encoder_attention_mask_2=cond.glyph_mask, return_dict=False)[0]

    def decode(self, latents, width, height, task) -> np.ndarray:
        """Videos (k, frames, height, width, 3), as the pipeline decodes them: one at a time
        (diffusers 0.42's VAE fails on a batch of several videos: its attention mask is one
        video's)."""
        vae, torch = self.pipe.vae, self.torch
        videos = [vae.decode(x.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]
                  for x in latents.split(1)]
        return to_uint8(self.pipe.video_processor.postprocess_video(torch.cat(videos),
                                                                    output_type="np"))

    decodes_in_parts = True

    def decode_parts(self, latents, width, height, task):
        """:meth:`decode`, a video at a time (the decode stage runs them one by one)."""
        return self.decode(latents, width, height, task)
        yield  # a generator of one part (never reached)


class HunyuanVideo15ImageToVideo(HunyuanVideo15):
    name = "hunyuan-video15-i2v"
    pipelines = ("HunyuanVideo15ImageToVideoPipeline",)
    generates = False  # its pipeline needs the first frame


FAMILIES = (HunyuanVideo15, HunyuanVideo15ImageToVideo)
