"""Flow-matching families whose transformer takes the latents packed 2x2 into tokens (Flux,
Qwen-Image): one schedule rule, one packing, and the calls of their pipelines' helpers, whose
signatures these pipelines share (some also return the tokens' position ids, which are dropped:
the family makes its own per size)."""

from __future__ import annotations


import numpy as np

from diffserve.executor.families.base import Family


def _latents(returned):
    """The latents a pipeline helper returns, alone or first of a tuple."""
    return returned[0] if isinstance(returned, tuple) else returned


class PackedFlow(Family):
    begins_at_index_zero = True
    patch = 2  # latent cells per token side

    def _position_ids(self, width: int, height: int, make):
        """The image tokens' position ids at this size, ``make()`` once while the size is in
        use (built on the host and copied up, they would cost a copy that waits for the device
        at every forward)."""
        return self._kept((width, height), make)

    def sampled_latents(self, processor, image: np.ndarray, width: int, height: int, k: int,
                        generators: list):
        """``image`` through the VAE, a sample of its latents for each of ``k`` generators, as
        the ControlNet pipelines encode a control image (before they draw their first noise)."""
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
        from PIL import Image

        vae = self.pipe.vae
        pixels = processor.preprocess(Image.fromarray(image), height=height, width=width)
        pixels = pixels.to(self.device, vae.dtype)
        if pixels.dim() == 4 and getattr(vae, "temperal_downsample", None) is not None:
            pixels = pixels.unsqueeze(2)  # a video VAE's frame axis (Qwen-Image's)
        parameters = vae.encode(pixels).latent_dist.parameters
        repeated = parameters.repeat(k, *([1] * (parameters.dim() - 1)))
        return DiagonalGaussianDistribution(repeated).sample(generators)

    def row_tokens(self, latents) -> int:
        if latents.dim() == 3:  # packed: (rows, tokens, channels)
            return latents.shape[1]
        return super().row_tokens(latents) // (self.patch * self.patch)  # patched in the model

    @property
    def _channels(self) -> int:
        return self.pipe.transformer.config.in_channels // (self.patch * self.patch)

    def schedule(self, scheduler, steps, width, height):
        """Sigmas from 1 to 1/steps (unless the scheduler makes its own), shifted by ``mu`` from
        the image's token count."""
        from diffusers.pipelines.flux.pipeline_flux import retrieve_timesteps

        sigmas = None if scheduler.config.get("use_flow_sigmas") else np.linspace(1.0, 1 / steps, steps)
        mu = self.shift(scheduler, width, height, self.patch)
        return retrieve_timesteps(scheduler, steps, self.device, sigmas=sigmas, mu=mu)[0]

    def unpack(self, latents, width, height):
        return self.pipe._unpack_latents(latents, height, width, self.pipe.vae_scale_factor)

    def noise_latents(self, k, width, height, dtype, generators):
        return _latents(self.pipe.prepare_latents(k, self._channels, height, width, dtype,
                                                  self.device, generators))

    def image_latents(self, pipe, init, start, k, width, height, dtype, generators):
        return _latents(pipe.prepare_latents(init, start, k, self._channels, height, width, dtype,
                                             self.device, generators))

    def inpaint_latents(self, pipe, init, start, full_strength, k, width, height, dtype, generators):
        latents, noise, image_latents = pipe.prepare_latents(
            init, start, k, self._channels, height, width, dtype, self.device, generators)[:3]
        return latents, noise, image_latents

    def mask_latents(self, pipe, condition, masked_image, k, width, height, dtype, generators):
        mask, _ = pipe.prepare_mask_latents(condition, masked_image, k, self._channels, 1, height,
                                            width, dtype, self.device, generators)
        return mask
