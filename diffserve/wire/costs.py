"""What an image costs the denoiser: its rows (two with classifier-free guidance) times a row's
cost at its size (:class:`RowCost`: its tokens, and where the model's FLOPs were fitted, its
attention's square too), in units of one row at the model's native size. By tokens alone a
1024x1024 image costs four times a 512x512 one; the same image with guidance costs twice one
without.

Torch-free: the frontend prices each request when it validates it, by the guidance rule the
model info carries, and the scheduler admits by the price it carries.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class RowCost:
    """One denoiser row's cost against its size p (its pixels, times its latent frames, over the
    native size's): ``a + b*p + c*p*p``, in units of one native row (a + b + c = 1). The linear
    layers grow with the tokens, self-attention with their square, what the text adds not at
    all: the model's FLOP fit gives the three (diffserve.executor.accel.flops); without one, the
    tokens alone (0, 1, 0)."""

    a: float = 0.0
    b: float = 1.0
    c: float = 0.0

    def __call__(self, p: float) -> float:
        return self.a + self.b * p + self.c * p * p

    @classmethod
    def of(cls, coefficients) -> "RowCost":
        return cls(*coefficients) if coefficients else cls()


TOKENS = RowCost()


def image_cost(width: int, height: int, native_width: int, native_height: int, cfg: bool,
               row: RowCost = TOKENS) -> float:
    return (2 if cfg else 1) * row((width * height) / (native_width * native_height))


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
               native_frames: int, stride: int, cfg: bool, row: RowCost = TOKENS) -> float:
    """A video's cost: its rows' cost at latent frames x latent pixels, in units of one row of
    the model's native size and frame count."""
    p = (width * height * latent_frames(frames, stride)
         / (native_width * native_height * latent_frames(native_frames, stride)))
    return (2 if cfg else 1) * row(p)
