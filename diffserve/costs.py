"""What an image costs the denoiser: its rows (two with classifier-free guidance) times its
latent pixels, in units of one row at the model's native size. A 1024x1024 image costs four times
a 512x512 one; the same image with guidance costs twice one without.

Torch-free: the frontend prices each request when it validates it, and the scheduler admits by
the price it carries.
"""

from __future__ import annotations


def uses_cfg(family: str | None, guidance_scale: float, negative_prompt: str) -> bool:
    """Whether a request runs classifier-free guidance: the step engine family's own rule, else
    (request mode, any pipeline) the common one, a scale above 1."""
    from diffserve.executor.families import family_named

    cls = family_named(family) if family else None
    return cls.uses_cfg(guidance_scale, negative_prompt) if cls else guidance_scale > 1


def image_cost(width: int, height: int, native_width: int, native_height: int, cfg: bool) -> float:
    return (2 if cfg else 1) * (width * height) / (native_width * native_height)


def default_bounds(max_batch_size: int, max_batch_cost: float, max_running_cost: float,
                   native_image_cost: float) -> tuple[float, float]:
    """(--max-batch-cost, --max-running-cost) with their automatic defaults resolved:
    ``max_batch_size`` native images at the model's default guidance, and twice that."""
    batch = max_batch_cost or max_batch_size * native_image_cost
    return batch, max_running_cost or 2 * batch
