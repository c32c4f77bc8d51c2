"""The stochastic sampler reinforcement-learning fine-tuning uses on flow-matching models
(Flow-GRPO, arXiv 2505.05470; DanceGRPO uses the same form): each Euler step of the flow ODE
becomes a step of an SDE with the same marginals, and every step's log-probability is kept.

With sigma the current noise level, sigma_next the next, d = sigma_next - sigma (< 0), v the
model's guided velocity, a the noise level and sigma_max the schedule's second sigma:

    s     = a * sqrt(sigma / (1 - sigma))        (sigma_max in the denominator where sigma = 1)
    mean  = x * (1 + s^2 d / (2 sigma)) + v * (1 + s^2 (1 - sigma) / (2 sigma)) * d
    x'    = mean + s * sqrt(-d) * eps,           eps ~ N(0, I) from the request's own generators
    log p = log N(x'; mean, (s sqrt(-d))^2 I), averaged over the latent's elements

With a = 0 it is the Euler step of the flow-matching scheduler, and no log-probability is kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

def sde_step(x, v, sigma: float, sigma_next: float, sigma_max: float, noise_level: float,
             generators: list):
    """(x', log p per sample or None) of one step, computed in float32. x' is rounded to the
    latents' own dtype before its log-probability is taken: in half precision the next step
    starts from that rounded value, and a trainer that recomputes the log-probability from the
    recorded latents must find the same figure (an importance ratio of exactly 1 on policy)."""
    import torch
    from diffusers.utils.torch_utils import randn_tensor

    dtype, x, v = x.dtype, x.float(), v.float()
    delta = sigma_next - sigma
    if noise_level == 0:
        return (x + v * delta).to(dtype), None
    s = noise_level * math.sqrt(sigma / (1 - (sigma_max if sigma >= 1 else sigma)))
    mean = x * (1 + s * s * delta / (2 * sigma)) + v * (1 + s * s * (1 - sigma) / (2 * sigma)) * delta
    std = s * math.sqrt(-delta)
    eps = randn_tensor(x.shape, generator=generators, device=x.device, dtype=torch.float32)
    x_next = (mean + std * eps).to(dtype)
    return x_next, log_prob(x_next.float(), mean, std)


def log_prob(x_next, mean, std: float):
    """log N(x_next; mean, std^2 I), averaged over each sample's elements."""
    elementwise = (-((x_next - mean) ** 2) / (2 * std * std) - math.log(std)
                   - 0.5 * math.log(2 * math.pi))
    return elementwise.flatten(1).mean(dim=1)


@dataclass
class Trajectory:
    """A rollout request's path through the denoising steps. The records stay on the device and
    go to the host once, at retirement (a copy per step would stall the whole running set)."""

    noise_level: float
    generators: list
    latents: list = field(default_factory=list)  # x_0 .. x_t so far (the family's layout)
    log_probs: list = field(default_factory=list)  # per step: [k]
    sigmas: list[float] | None = None  # the schedule's sigmas on the host, read once

    def step(self, scheduler, index: int, x, v):
        """x_{index+1} from x_index and the guided velocity ``v``, recorded."""
        if self.sigmas is None:
            self.sigmas = [float(s) for s in scheduler.sigmas]
        sigmas = self.sigmas
        if not self.latents:
            self.latents.append(x.detach())
        x_next, lp = sde_step(x, v, sigmas[index], sigmas[index + 1], sigmas[1],
                              self.noise_level, self.generators)
        self.latents.append(x_next.detach())
        if lp is not None:
            self.log_probs.append(lp)
        return x_next

    def tensors(self, family, scheduler, timesteps, width: int, height: int, images, positive,
                returns: tuple[str, ...]) -> dict[str, Any]:
        """The answer's tensors (see :mod:`diffserve.wire.rollouts`), as numpy arrays."""
        import torch

        out: dict[str, Any] = {}
        if "latents" in returns:
            steps = [family.image_latents_of(x, width, height) for x in self.latents]
            out["latents"] = torch.stack(steps, dim=1).float().cpu().numpy()
        if "log_probs" in returns and self.log_probs:
            out["log_probs"] = torch.stack(self.log_probs, dim=1).float().cpu().numpy()
        if "timesteps" in returns:
            out["timesteps"] = torch.as_tensor(timesteps).float().cpu().numpy()
            out["sigmas"] = scheduler.sigmas[:len(timesteps) + 1].float().cpu().numpy()
        if "images" in returns:
            out["images"] = images
        if "prompt_embeds" in returns:
            out.update({name: t.float().cpu().numpy()
                        for name, t in positive.rows(0, 1).prompt_tensors().items()})
        return out
