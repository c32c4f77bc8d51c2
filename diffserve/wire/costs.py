"""What an image costs the denoiser: its rows (two with classifier-free guidance) times its
latent pixels, in units of one row at the model's native size. A 1024x1024 image costs four times
a 512x512 one; the same image with guidance costs twice one without.

Torch-free: the frontend prices each request when it validates it, by the guidance rule the
model info carries, and the scheduler admits by the price it carries.
"""

from __future__ import annotations

# When a pipeline runs classifier-free guidance (two rows an image):
ABOVE_ONE = "above_one"  # a guidance scale above 1 (most pipelines; request mode's rule)
ABOVE_ZERO = "above_zero"  # a scale above 0 (Z-Image, whose scale counts from 0: pos + g(pos-neg))
WITH_NEGATIVE = "with_negative"  # a scale above 1 and a negative prompt (Qwen-Image's true CFG)
NEVER = "never"  # guidance is an input of the denoiser, one row an image (Flux)
GUIDANCE_RULES = (ABOVE_ONE, ABOVE_ZERO, WITH_NEGATIVE, NEVER)


def uses_cfg(rule: str, guidance_scale: float, negative_prompt: str) -> bool:
    """Whether a request runs classifier-free guidance under ``rule``."""
    if rule == NEVER:
        return False
    if rule == WITH_NEGATIVE and not negative_prompt:
        return False
    if rule not in GUIDANCE_RULES:
        raise ValueError(f"unknown guidance rule {rule!r}")
    return guidance_scale > (0 if rule == ABOVE_ZERO else 1)


def image_cost(width: int, height: int, native_width: int, native_height: int, cfg: bool) -> float:
    return (2 if cfg else 1) * (width * height) / (native_width * native_height)


def default_bounds(max_batch_size: int, max_batch_cost: float, max_running_cost: float,
                   native_image_cost: float) -> tuple[float, float]:
    """(--max-batch-cost, --max-running-cost) with their automatic defaults resolved:
    ``max_batch_size`` native images at the model's default guidance, and twice that."""
    batch = max_batch_cost or max_batch_size * native_image_cost
    return batch, max_running_cost or 2 * batch


def latent_frames(frames: int, stride: int) -> int:
    """The latent frames a video VAE with temporal ``stride`` makes of ``frames`` (first frame
    alone, then one per ``stride``); an image (0 frames) is one."""
    return (frames - 1) // stride + 1 if frames > 0 else 1


def video_cost(width: int, height: int, frames: int, native_width: int, native_height: int,
               native_frames: int, stride: int, cfg: bool) -> float:
    """A video's cost: latent frames x latent pixels x rows, in units of one row of the model's
    native size and frame count."""
    return (image_cost(width, height, native_width, native_height, cfg)
            * latent_frames(frames, stride) / latent_frames(native_frames, stride))
