"""Stable Diffusion XL: a UNet with added text and size conditioning, two CLIP text encoders."""

from __future__ import annotations

from diffserve.executor.families.base import Conditioning, rows
from diffserve.executor.families.sd import StableDiffusion
from diffserve.protocol import GENERATE


class StableDiffusionXL(StableDiffusion):
    name = "stable-diffusion-xl"
    pipelines = ("StableDiffusionXLPipeline",)

    def encode(self, prompts, negatives, cfg):
        positive, negative, pooled, negative_pooled = self.pipe.encode_prompt(
            prompts, device=self.device, num_images_per_prompt=1, do_classifier_free_guidance=cfg,
            negative_prompt=negatives)
        return Conditioning({"encoder_hidden_states": positive, "text_embeds": pooled},
                            {"encoder_hidden_states": negative, "text_embeds": negative_pooled}
                            if cfg else None)

    def forward(self, latents, timesteps, cond, guidance, width, height):
        added = {"text_embeds": cond["text_embeds"], "time_ids": cond["time_ids"]}
        return self.pipe.unet(latents, timesteps, encoder_hidden_states=cond["encoder_hidden_states"],
                              added_cond_kwargs=added, return_dict=False)[0]

    def prepare(self, task, scheduler, steps, strength, width, height, generators, cond_dtype,
                image=None, mask=None):
        prepared = super().prepare(task, scheduler, steps, strength, width, height, generators,
                                   cond_dtype, image, mask)
        k = len(generators)
        if task == GENERATE:
            if hasattr(scheduler, "set_begin_index"):
                scheduler.set_begin_index(0)
            ids = self.pipe._get_add_time_ids((height, width), (0, 0), (height, width),
                                              dtype=cond_dtype,
                                              text_encoder_projection_dim=self._projection_dim())
            positive = negative = ids
        else:  # the edit pipelines add aesthetic scores where the model was trained with them
            positive, negative = self.edits[task]._get_add_time_ids(
                (height, width), (0, 0), (height, width), 6.0, 2.5, (height, width), (0, 0),
                (height, width), dtype=cond_dtype, text_encoder_projection_dim=self._projection_dim())
        prepared.cond = Conditioning({"time_ids": rows(positive, k).to(self.device)},
                                     {"time_ids": rows(negative, k).to(self.device)})
        return prepared

    def _projection_dim(self) -> int:
        encoder = self.pipe.text_encoder_2
        return int(encoder.config.projection_dim) if encoder is not None else int(
            self.pipe.unet.config.projection_class_embeddings_input_dim)

    def decode(self, latents, width, height, task=GENERATE):
        torch, vae = self.torch, self.pipe.vae
        upcast = vae.dtype == torch.float16 and vae.config.force_upcast
        if upcast:
            self.pipe.upcast_vae()
            latents = latents.to(next(iter(vae.post_quant_conv.parameters())).dtype)
        mean, std = getattr(vae.config, "latents_mean", None), getattr(vae.config, "latents_std", None)
        if mean is not None and std is not None:
            shape = (1, len(mean), 1, 1)
            mean = torch.tensor(mean).view(shape).to(latents.device, latents.dtype)
            std = torch.tensor(std).view(shape).to(latents.device, latents.dtype)
            latents = latents * std / vae.config.scaling_factor + mean
        else:
            latents = latents / vae.config.scaling_factor
        image = vae.decode(latents, return_dict=False)[0]
        if upcast:
            vae.to(dtype=torch.float16)
        return self._postprocess(image)
