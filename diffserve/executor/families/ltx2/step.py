"""LTX-2: one DiT denoises a video's latents and its sound's latents together, each modality
attending to the other; Gemma 3's hidden states go through the pipeline's connectors into one
text encoding for each modality; flow matching (Euler) over a schedule shifted by the video's
token count. The video VAE decodes the frames, the audio VAE a mel spectrogram and the vocoder
the waveform.

- **A row's state is both modalities' latents**: the video's packed tokens then the sound's,
  flattened into one row (``[k, video + audio]``), so that the engine stacks, guides and steps
  them as it does any latents. Both take the same schedule (the pipeline steps a copy of its
  scheduler for the sound with the same sigmas), and an Euler step is the same on each part as
  on the whole. The forward cuts each row back into its two parts.
- **Guidance**: classifier-free guidance of each modality with its own scale (the sound's is
  ``audio_guidance_scale`` where the model's keywords set one, else the video's), as the
  pipeline's guidance with its spatio-temporal, modality-isolation and rescale terms off (the
  served keywords set them off; a model that keeps them on fails its start-up check and runs
  in request mode).
- **Sizes**: the rows of one forward share a size and frame count (both are request shapes), so
  each size and length is a running set of its own, as for Wan.
- **Image-to-video** (``LTX2ImageToVideoPipeline``, built over the same components): the first
  latent frame is the input image's (re-compressed as the pipeline does, then through the VAE)
  and stays clean: its tokens take timestep 0 while the rest take the row's, and each step
  leaves them as they are. Rows of both tasks share forwards (every row carries its tokens'
  mask; a text-to-video row's is zeros).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from diffserve.executor.families.base import Family
from diffserve.executor.families.conditioning import (
    Conditioning,
    Encoded,
    Prepared,
    on_host,
)
from diffserve.executor.families.outputs import Sounded, to_uint8


@dataclass
class LTX2Conditioning(Conditioning):
    video_embeds: Any  # the connectors' text encoding for the video stream
    audio_embeds: Any  # ... and for the audio stream
    mask: Any  # the connectors' attention mask over the text tokens
    frames: tuple = on_host()  # each row's video frame count (set per request)
    clean: Any = None  # per video token: 1 where it is the input image's (image-to-video)
    first_frame: tuple = on_host()  # whether each row starts from an input image


@dataclass(frozen=True)
class Layout:
    """Where a row's parts are: latent frames x height x width video tokens of ``video_channels``,
    then ``audio_frames`` audio tokens of ``audio_channels``."""

    frames: int
    height: int
    width: int
    video_channels: int
    audio_frames: int
    audio_channels: int

    @property
    def video_size(self) -> int:
        return self.frames * self.height * self.width * self.video_channels


class LTX2(Family):
    name = "ltx2"
    pipelines = ("LTX2Pipeline",)
    begins_at_index_zero = True
    first_frame_pipeline = "LTX2ImageToVideoPipeline"

    def __init__(self, pipe, pipelines, call_kwargs) -> None:
        super().__init__(pipe, pipelines, call_kwargs)
        from diffusers.pipelines.ltx2.utils import conditioning_frame_rate

        self.frame_rate = float(call_kwargs.get("frame_rate", 24.0))
        self.fps = conditioning_frame_rate(self.frame_rate, call_kwargs.get("motion_speed", 1.0))
        self.audio_scale = call_kwargs.get("audio_guidance_scale")
        self._split = 0  # the video part's size in the rows of the last forward

    def encode(self, prompts, negatives, cfg):
        pipe, dtype = self.pipe, self.dtype
        positive, positive_mask, negative, negative_mask = pipe.encode_prompt(
            prompts, negatives, do_classifier_free_guidance=cfg,
            max_sequence_length=self.call_kwargs.get("max_sequence_length", 1024),
            device=self.device)
        side = getattr(pipe.tokenizer, "padding_side", "left")

        def connected(embeds, mask):
            video, audio, joined = pipe.connectors(embeds, mask, padding_side=side)
            return LTX2Conditioning(video.to(dtype), audio.to(dtype), joined)

        return Encoded(connected(positive, positive_mask),
                       connected(negative, negative_mask) if cfg else None)

    def layout(self, width: int, height: int, frames: int) -> Layout:
        """A video's latent layout, as the pipeline computes it."""
        pipe = self.pipe
        audio_rate = (pipe.audio_sampling_rate / pipe.audio_hop_length
                      / float(pipe.audio_vae_temporal_compression_ratio))
        mel_bins = pipe.audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
        return Layout((frames - 1) // pipe.vae_temporal_compression_ratio + 1,
                      height // pipe.vae_spatial_compression_ratio,
                      width // pipe.vae_spatial_compression_ratio,
                      pipe.transformer.config.in_channels,
                      round(frames / self.frame_rate * audio_rate),
                      pipe.audio_vae.config.latent_channels * mel_bins)

    def schedule(self, scheduler, steps, width, height, frames=1):
        from diffusers.pipelines.ltx2.pipeline_ltx2 import (
            calculate_shift,
            retrieve_timesteps,
        )

        config, layout = scheduler.config, self.layout(width, height, frames)
        mu = calculate_shift(layout.frames * layout.height * layout.width,
                             config.get("base_image_seq_len", 1024),
                             config.get("max_image_seq_len", 4096),
                             config.get("base_shift", 0.95), config.get("max_shift", 2.05))
        sigmas = np.linspace(1.0, 1 / steps, steps)
        return retrieve_timesteps(scheduler, steps, self.device, None, sigmas=sigmas, mu=mu)[0]

    def prepare(self, task, scheduler, steps, strength, width, height, generators, encoded,
                inputs, frames=0, controls=()) -> Prepared:
        """The video's noise, then the sound's, from each row's generator in the pipeline's
        order (float32, as it draws them), flattened into one row each."""
        pipe, k, torch = self.pipe, len(generators), self.torch
        timesteps = self.schedule(scheduler, steps, width, height, frames)
        scheduler.set_begin_index(0)
        layout = self.layout(width, height, frames)
        if task.first_frame:
            video, clean = self._first_frame_latents(inputs["image"], k, width, height, frames,
                                                     encoded.positive.dtype, generators)
        else:
            video = pipe.prepare_latents(k, layout.video_channels, height, width, frames, 0.0,
                                         torch.float32, self.device, generators)
            clean = video.new_zeros(video.shape[:2])
        audio = pipe.prepare_audio_latents(
            k, pipe.audio_vae.config.latent_channels, layout.audio_frames,
            pipe.audio_vae.config.mel_bins, 0.0, torch.float32, self.device, generators)
        latents = torch.cat([video.flatten(1), audio.flatten(1)], dim=1)
        rows = {"frames": (frames,) * k, "clean": clean, "first_frame": (task.first_frame,) * k}
        positive = dataclasses.replace(encoded.positive, **rows)
        negative = (None if encoded.negative is None
                    else dataclasses.replace(encoded.negative, **rows))
        # Each step leaves the clean tokens (the input image's) as they are.
        keep = (torch.cat([clean.repeat_interleave(layout.video_channels, dim=1),
                           clean.new_zeros(k, audio[0].numel())], dim=1) > 0.5
                if task.first_frame else None)
        return Prepared(timesteps, latents, positive, negative, {"keep": keep})

    def _first_frame_latents(self, image, k, width, height, frames, dtype, generators):
        """The video's first latents and their clean tokens, by the image-to-video pipeline's
        own helpers: the input re-compressed at its CRF, preprocessed, encoded."""
        from diffusers.pipelines.ltx2.utils import (
            apply_image_conditioning_crf,
            resolve_default_image_crf,
        )
        from PIL import Image

        pipe = self.pipelines["image-to-video"]
        crf = resolve_default_image_crf(pipe.text_encoder)
        picture = image if crf == 0 else apply_image_conditioning_crf(image, crf)
        tensor = pipe.video_processor.preprocess(Image.fromarray(picture), height=height,
                                                 width=width).to(self.device, dtype=dtype)
        return pipe.prepare_latents(tensor.repeat(k, 1, 1, 1), k, pipe.transformer.config.in_channels,
                                    height, width, frames, 0.0, self.torch.float32, self.device,
                                    generators)

    def denoise_step(self, scheduler, prediction, timestep, latents, step_kwargs):
        """The scheduler's step, the image-to-video rows' clean tokens left as they were."""
        keep = step_kwargs.get("keep")
        stepped = scheduler.step(prediction, timestep, latents, return_dict=False)[0]
        return stepped if keep is None else self.torch.where(keep, latents, stepped)

    def parts(self, latents, layout: Layout):
        """A row block's video tokens and audio tokens."""
        k, cut = latents.shape[0], layout.video_size
        return (latents[:, :cut].reshape(k, -1, layout.video_channels),
                latents[:, cut:].reshape(k, layout.audio_frames, layout.audio_channels))

    def forward(self, latents, timesteps, cond, guidance, width, height):
        layout = self.layout(width, height, cond.frames[0])
        self._split = layout.video_size
        transformer, k, dtype = self.pipe.transformer, latents.shape[0], self.dtype
        video, audio = self.parts(latents, layout)
        video_coords = transformer.rope.prepare_video_coords(
            k, layout.frames, layout.height, layout.width, latents.device, fps=self.fps)
        audio_coords = transformer.audio_rope.prepare_audio_coords(
            k, layout.audio_frames, latents.device)
        # Image-to-video rows: timestep 0 for the clean tokens (a text-to-video row among them
        # has none, and the same timestep for every token).
        per_token = any(cond.first_frame)
        video_timesteps = timesteps[:, None] * (1 - cond.clean) if per_token else timesteps
        video_out, audio_out = transformer(
            hidden_states=video.to(dtype), audio_hidden_states=audio.to(dtype),
            encoder_hidden_states=cond.video_embeds, audio_encoder_hidden_states=cond.audio_embeds,
            timestep=video_timesteps, audio_timestep=timesteps if per_token else None,
            sigma=timesteps, encoder_attention_mask=cond.mask,
            audio_encoder_attention_mask=cond.mask, num_frames=layout.frames,
            height=layout.height, width=layout.width, fps=self.fps,
            audio_num_frames=layout.audio_frames, video_coords=video_coords,
            audio_coords=audio_coords, isolate_modalities=False,
            use_cross_timestep=self.call_kwargs.get("use_cross_timestep", True),
            return_dict=False)
        return self.torch.cat([video_out.float().flatten(1), audio_out.float().flatten(1)], 1)

    def guide(self, uncond, cond, scale: float):
        """Each modality with its own scale: the sound's part of the rows after the video's."""
        guided = uncond + scale * (cond - uncond)
        audio = self.audio_scale
        if audio is not None and audio != scale:
            cut = self._split
            guided[:, cut:] = uncond[:, cut:] + audio * (cond[:, cut:] - uncond[:, cut:])
        return guided

    # -- at the end ------------------------------------------------------------------------

    def decode(self, latents, width, height, task) -> np.ndarray:
        """Videos (k, frames, height, width, 3), as the pipeline decodes them."""
        return self.decode_both(latents, width, height, sound=False).pixels

    decodes_in_parts = True

    def decode_parts(self, latents, width, height, task):
        """The frames and the sound track of each finished video (one part)."""
        return self.decode_both(latents, width, height)
        yield  # a generator of one part (never reached)

    def decode_both(self, latents, width, height, sound: bool = True) -> Sounded:
        pipe, torch = self.pipe, self.torch
        frames = self._frames_of(latents, width, height)
        layout = self.layout(width, height, frames)
        video, audio = self.parts(latents, layout)
        video = pipe._unpack_latents(video, layout.frames, layout.height, layout.width,
                                     pipe.transformer_spatial_patch_size,
                                     pipe.transformer_temporal_patch_size).to(self.dtype)
        timestep = None
        if pipe.vae.config.timestep_conditioning:  # decode_timestep 0: no noise mixed in
            timestep = torch.zeros(video.shape[0], device=video.device, dtype=video.dtype)
        video = pipe._denormalize_latents(video, pipe.vae.latents_mean, pipe.vae.latents_std,
                                          pipe.vae.config.scaling_factor)
        video = pipe.vae.decode(video.to(pipe.vae.dtype), timestep, return_dict=False)[0]
        pixels = to_uint8(pipe.video_processor.postprocess_video(video, output_type="np"))
        if not sound:
            return Sounded(pixels, None, 0)
        audio = pipe._denormalize_audio_latents(audio, pipe.audio_vae.latents_mean,
                                                pipe.audio_vae.latents_std)
        mel_bins = pipe.audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
        audio = pipe._unpack_audio_latents(audio, layout.audio_frames, num_mel_bins=mel_bins)
        mel = pipe.audio_vae.decode(audio.to(pipe.audio_vae.dtype), return_dict=False)[0]
        wave = pipe.vocoder(mel).float().cpu().numpy()
        return Sounded(pixels, wave, sample_rate(pipe))

    def _frames_of(self, latents, width: int, height: int) -> int:
        """The frame count whose layout fills a row of ``latents`` (the rows carry no other
        record of it at the end)."""
        stride = self.pipe.vae_temporal_compression_ratio
        latent_frames = 1
        while True:
            frames = (latent_frames - 1) * stride + 1
            layout = self.layout(width, height, frames)
            size = layout.video_size + layout.audio_frames * layout.audio_channels
            if size == latents.shape[1]:
                return frames
            if layout.video_size > latents.shape[1]:
                raise ValueError(f"no frame count fills latents of {latents.shape[1]} values")
            latent_frames += 1


def sample_rate(pipe) -> int:
    """The sound track's samples a second: the vocoder's output rate."""
    return int(pipe.vocoder.config.output_sampling_rate)


FAMILIES = (LTX2,)
