"""Rollouts for reinforcement-learning trainers: what a request may ask back, and the answer's
format. Torch-free (the frontend builds the answer; the executor computes it, see
:mod:`diffserve.executor.step.rollout`).

The answer is one safetensors file. Its tensors, per request of ``n`` images and ``T`` steps:

- ``latents`` float32 [n, T+1, C, h, w]: the trajectory x_0 (pure noise) .. x_T (the final
  latents), unpacked (the layout of the VAE's input: Flux and Qwen-Image pack 2x2 latent cells
  into each transformer token; unpacking is what their pipelines do before decoding);
- ``log_probs`` float32 [n, T]: log p(x_{t+1} | x_t) of each step under the sampler, averaged
  over the latent's elements (only when ``noise_level`` > 0);
- ``timesteps`` float32 [T] and ``sigmas`` float32 [T+1]: the schedule (sigma T is 0);
- ``images`` uint8 [n, H, W, 3];
- ``prompt_embeds`` float32 [L, D] (and ``pooled_prompt_embeds`` [D] where the family has them):
  the prompt's encoding, as the denoiser took it (only when asked for).

Its metadata holds the request's fields (``request``, JSON), the seeds of its images
(``seeds``), the served model (``model``) and the latent layout (``latents_layout``).
"""

from __future__ import annotations

import json
from typing import Any

RETURNABLE = ("latents", "log_probs", "timesteps", "images", "prompt_embeds")
DEFAULT_RETURN = ("latents", "log_probs", "timesteps", "images")
# Tensors that describe the request as a whole; the others have one row per image.
PER_REQUEST = frozenset({"timesteps", "sigmas", "prompt_embeds", "pooled_prompt_embeds"})
LATENTS_LAYOUT = "[n, T+1, C, h, w]: x_0 (noise) .. x_T, unpacked as the VAE takes them"


def join_parts(parts: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    """One request's tensors from the parts it was split into (start index, tensors): per-image
    tensors in image order, per-request ones from the first part."""
    import numpy as np

    parts = sorted(parts, key=lambda part: part[0])
    first = parts[0][1]
    return {name: first[name] if name in PER_REQUEST else
            np.concatenate([tensors[name] for _, tensors in parts]) for name in first}


def safetensors_body(tensors: dict[str, Any], metadata: dict[str, Any]) -> bytes:
    from safetensors.numpy import save

    return save({k: v for k, v in tensors.items()},
                metadata={k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()})
