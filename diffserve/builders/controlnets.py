"""Tiny ControlNets for the tiny models, built offline from their denoisers (diffusers'
``from_unet`` / ``from_transformer``). A ControlNet starts with zero-initialised output layers, so
that it changes nothing until trained; here those layers get random weights from a seed of their
own, so that each control visibly changes the image (and two models change it differently)."""

from __future__ import annotations

from functools import partial
from pathlib import Path


def _woken(module, seed: int, std: float):
    """``module`` with every all-zero parameter (the zero-initialised output layers) drawn from a
    normal distribution of ``std``."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    for parameter in module.parameters():
        if not parameter.detach().abs().sum():
            parameter.data = torch.randn(parameter.shape, generator=generator) * std
    return module


def _denoiser(base: Path):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(base)
    return getattr(pipe, "unet", None) or pipe.transformer


def build_unet(directory: Path, base: Path, seed: int, std: float = 0.3) -> None:
    """A ControlNetModel from the UNet of the pipeline at ``base`` (tiny-sd, tiny-sdxl). Its
    control image's embedding is scaled down with the UNet: diffusers' default (16, 32, 96, 256
    channels) is 0.3% of SD 1.5's ControlNet but would be half of a tiny one, whose cost (its
    parameters over the UNet's, 0.42 for SD 1.5's) would then be twice the real one's."""
    import torch
    from diffusers import ControlNetModel

    torch.manual_seed(seed)
    model = ControlNetModel.from_unet(_denoiser(base),  # four sizes: 3 halvings, the VAE's 8x
                                      conditioning_embedding_out_channels=(8, 16, 16, 32))
    _woken(model, seed, std).save_pretrained(directory)


def build_flux(directory: Path, base: Path, seed: int, modes: int | None = None,
               std: float = 0.05) -> None:
    """A FluxControlNetModel (InstantX's kind: the control image through the VAE) from tiny-flux's
    transformer: one double and one single block; ``modes``: a union model's control types."""
    import torch
    from diffusers import FluxControlNetModel

    transformer = _denoiser(base)
    config = transformer.config
    torch.manual_seed(seed)
    model = FluxControlNetModel.from_transformer(
        transformer, num_layers=1, num_single_layers=1,
        attention_head_dim=config.attention_head_dim, num_attention_heads=config.num_attention_heads)
    if modes:  # the union kind: the same, and an embedding of the control type
        base = model
        config = {k: v for k, v in base.config.items() if not k.startswith("_")}
        model = FluxControlNetModel.from_config({**config, "num_mode": modes})
        model.load_state_dict(base.state_dict(), strict=False)
    _woken(model, seed, std).save_pretrained(directory)


def build_qwen_image(directory: Path, base: Path, seed: int, std: float = 0.05) -> None:
    """A QwenImageControlNetModel from tiny-qwen-image's transformer, one block."""
    import torch
    from diffusers import QwenImageControlNetModel

    transformer = _denoiser(base)
    config = transformer.config
    torch.manual_seed(seed)
    model = QwenImageControlNetModel.from_transformer(
        transformer, num_layers=1, attention_head_dim=config.attention_head_dim,
        num_attention_heads=config.num_attention_heads)
    _woken(model, seed, std).save_pretrained(directory)


# name -> (description, the embedded model it controls, builder(directory, that model's directory))
EMBEDDED_CONTROLNETS = {
    "tiny-sd-control": ("a ControlNet of tiny-sd with random output layers", "tiny-sd",
                        partial(build_unet, seed=1)),
    "tiny-sd-control-b": ("a second ControlNet of tiny-sd (other random output layers)",
                          "tiny-sd", partial(build_unet, seed=2)),
    "tiny-sdxl-control": ("a ControlNet of tiny-sdxl with random output layers", "tiny-sdxl",
                          partial(build_unet, seed=3)),
    "tiny-flux-control": ("a Flux ControlNet (InstantX's kind) of tiny-flux", "tiny-flux",
                          partial(build_flux, seed=4)),
    "tiny-flux-control-union": ("a Flux union ControlNet of tiny-flux, 3 control types",
                                "tiny-flux", partial(build_flux, seed=5, modes=3)),
    "tiny-qwen-image-control": ("a Qwen-Image ControlNet of tiny-qwen-image", "tiny-qwen-image",
                                partial(build_qwen_image, seed=6)),
}
