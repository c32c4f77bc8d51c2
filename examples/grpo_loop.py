"""Online GRPO with diffserve as the rollout server, closed on one CPU: rollouts of n samples per
prompt (trajectories and log-probabilities) -> a reward from each image -> group-relative
advantages -> a clipped policy-gradient step on the trainer's own copy of the denoiser, with the
log-probabilities recomputed from the recorded trajectory -> the new weights sent to the server
straight from memory (``update_weights``) -> the next rollouts, stamped with the new version.

    diffserve serve --model tiny-flux --batching-mode step --max-n 16 --enable-weight-updates \\
        --weights-dir /tmp/weights &
    python examples/grpo_loop.py --url http://127.0.0.1:8000

The trainer loads the same model from its files (diffserve's embedded tiny FLUX here) and trains
the whole denoiser; with a LoRA it would train PEFT's adapter weights instead and send those with
``POST /v1/load_lora_adapter``. The reward (how much redder than green and blue an image is) is a
stand-in for a real reward model.
"""
from __future__ import annotations

import argparse
import math

import torch

from diffserve.client import Client

PROMPTS = ["a red circle", "a blue square"]
GUIDANCE = 3.5


def reward(images: torch.Tensor) -> torch.Tensor:
    """Per image [n, H, W, 3] uint8: how much redder than green and blue it is."""
    x = images.float() / 255
    return x[..., 0].mean((1, 2)) - x[..., 1:].mean((1, 2, 3))


class Trainer:
    """The denoiser being trained, and the rollout sampler's log-probability under it."""

    def __init__(self, model: str, lr: float, noise_level: float) -> None:
        from diffusers import DiffusionPipeline

        from diffserve.builders.registry import resolve_model, serving_defaults

        path = resolve_model(model)
        self.pipe = DiffusionPipeline.from_pretrained(path)
        self.max_sequence_length = serving_defaults(path).get("pipeline_kwargs", {}).get(
            "max_sequence_length", 512)
        self.denoiser = self.pipe.transformer.train()
        self.optimizer = torch.optim.Adam(self.denoiser.parameters(), lr=lr)
        self.noise_level = noise_level

    def velocity(self, prompt: str, x: torch.Tensor, t: float) -> torch.Tensor:
        """The denoiser's velocity for latents x [n, C, h, w] at timestep t (with Flux's guidance
        embedding where the model has one, as the server runs it), with gradients."""
        pipe, (n, c, h, w) = self.pipe, x.shape
        with torch.no_grad():
            embeds, pooled, text_ids = pipe.encode_prompt(
                prompt, None, num_images_per_prompt=n, max_sequence_length=self.max_sequence_length)
        ids = pipe._prepare_latent_image_ids(n, h // 2, w // 2, x.device, x.dtype)
        guidance = torch.full((n,), GUIDANCE) if self.denoiser.config.guidance_embeds else None
        out = self.denoiser(hidden_states=pipe._pack_latents(x, n, c, h, w),
                            timestep=torch.full((n,), t / 1000), guidance=guidance,
                            pooled_projections=pooled, encoder_hidden_states=embeds, txt_ids=text_ids,
                            img_ids=ids, return_dict=False)[0]
        return pipe._unpack_latents(out, 8 * h, 8 * w, pipe.vae_scale_factor)

    def log_probs(self, prompt: str, latents, timesteps, sigmas) -> torch.Tensor:
        """log p(x_{t+1} | x_t) of each sample and step [n, T] under the current weights: the
        server's SDE step (docs/rollouts.md), its mean from the trainer's velocity."""
        a, out = self.noise_level, []
        for step in range(len(timesteps)):
            x, nxt = latents[:, step], latents[:, step + 1]
            s_t, s_n = float(sigmas[step]), float(sigmas[step + 1])
            d = s_n - s_t
            s = a * math.sqrt(s_t / (1 - (float(sigmas[1]) if s_t >= 1 else s_t)))
            v = self.velocity(prompt, x, float(timesteps[step]))
            mean = x * (1 + s * s * d / (2 * s_t)) + v * (1 + s * s * (1 - s_t) / (2 * s_t)) * d
            std = s * math.sqrt(-d)
            lp = -((nxt - mean) ** 2) / (2 * std * std) - math.log(std) - 0.5 * math.log(2 * math.pi)
            out.append(lp.mean(dim=(1, 2, 3)))
        return torch.stack(out, dim=1)

    def step(self, groups, clip: float = 0.2) -> dict:
        """One clipped GRPO step over every prompt's group; what it saw."""
        self.optimizer.zero_grad()
        losses, ratios = [], []
        for prompt, group in zip(PROMPTS, groups):
            rewards = reward(group.images)
            advantages = ((rewards - rewards.mean()) / (rewards.std() + 1e-4))[:, None]
            new = self.log_probs(prompt, group.latents, group.timesteps, group.sigmas)
            ratio = torch.exp(new - group.log_probs)
            loss = -torch.minimum(ratio * advantages,
                                  ratio.clamp(1 - clip, 1 + clip) * advantages).mean()
            (loss / len(PROMPTS)).backward()
            losses.append(loss.item())
            ratios.append((ratio.detach() - 1).abs().max().item())
        self.optimizer.step()
        return {"loss": sum(losses) / len(losses), "first ratio off 1 by": max(ratios)}


def run(url: str, iterations: int, n: int, steps: int, lr: float, noise_level: float,
        model: str = "tiny-flux", seed: int = 0) -> list[dict]:
    """The loop; one record per iteration (reward, version, loss)."""
    torch.manual_seed(seed)
    trainer, records = Trainer(model, lr, noise_level), []
    with Client(url) as client:
        # Start where the trainer is: the server serves the trainer's weights from here on, each
        # version named by the trainer's step.
        client.update_weights(tensors=trainer.denoiser.state_dict(), weight_version="step-0")
        for iteration in range(iterations):
            groups = client.rollout(PROMPTS, n=n, num_inference_steps=steps, guidance_scale=GUIDANCE,
                                    noise_level=noise_level, seed=seed + 1000 * iteration,
                                    **{"return": ["latents", "log_probs", "timesteps", "images"]})
            record = {"iteration": iteration, "weight_version": groups[0].weight_version,
                      "reward": torch.cat([reward(g.images) for g in groups]).mean().item()}
            record.update(trainer.step(groups))
            record["sent"] = client.update_weights(tensors=trainer.denoiser.state_dict(),
                                                   weight_version=f"step-{iteration + 1}")["weight_version"]
            records.append(record)
            print(f"iteration {iteration}: rollouts by version {record['weight_version']}, reward "
                  f"{record['reward']:+.4f}, loss {record['loss']:+.4f}, ratio off 1 by "
                  f"{record['first ratio off 1 by']:.1e}; the server now serves version {record['sent']}",
                  flush=True)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--n", type=int, default=8, help="Samples per prompt (a group).")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-2)
    parser.add_argument("--noise-level", type=float, default=0.7)
    args = parser.parse_args()
    run(args.url, args.iterations, args.n, args.steps, args.lr, args.noise_level)


if __name__ == "__main__":
    main()
