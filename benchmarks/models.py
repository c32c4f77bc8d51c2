"""Build a mid-size Stable Diffusion pipeline with random weights, for benchmarks.

The embedded ``tiny-sd`` model is so small that per-request overheads (HTTP, encoding, IPC)
weigh as much as the model itself. This builder makes a model whose UNet (about 30M
parameters, 128x128 pixels, 16x16 latents) costs enough per step for batching to matter the
way it does with real models, while still running on a CPU and needing no download. Weights
are drawn from a fixed seed, so every build is identical and the images are noise.

    python benchmarks/models.py --out /tmp/sd-mid
    diffserve serve --model /tmp/sd-mid
    python benchmarks/compare.py --model /tmp/sd-mid
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

SIZE = 128            # native width and height in pixels
VAE_SCALE = 8         # pixels per latent cell (three VAE downsamplings)
DEFAULTS = {
    "width": SIZE,
    "height": SIZE,
    "spatial_stride": VAE_SCALE,
    "num_inference_steps": 4,
    "guidance_scale": 5.0,
}


def _param_millions(module) -> float:
    return sum(p.numel() for p in module.parameters()) / 1e6


def build_mid_sd(directory: Path, unet_channels: tuple[int, ...] = (96, 192, 384),
                 seed: int = 0) -> dict[str, float]:
    """Write the pipeline to ``directory`` (which must not exist yet or be empty).
    Returns the parameter count of each component, in millions."""
    import diffusers
    import torch
    from diffusers import (AutoencoderKL, DDIMScheduler, StableDiffusionPipeline,
                           UNet2DConditionModel)
    from transformers import CLIPTextConfig, CLIPTextModel

    from diffserve.models.tokenizers import write_byte_clip_tokenizer

    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    text_dim = 256
    levels = len(unet_channels)
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=SIZE // VAE_SCALE, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=unet_channels,
        down_block_types=("CrossAttnDownBlock2D",) * (levels - 1) + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (levels - 1),
        cross_attention_dim=text_dim, attention_head_dim=8, norm_num_groups=32)
    torch.manual_seed(seed + 1)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 64, 128, 128),
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=1, norm_num_groups=32, sample_size=SIZE)
    torch.manual_seed(seed + 2)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=514, hidden_size=text_dim, intermediate_size=4 * text_dim, num_hidden_layers=4,
        num_attention_heads=4, max_position_embeddings=77, bos_token_id=512, eos_token_id=513,
        pad_token_id=513, projection_dim=text_dim))
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = write_byte_clip_tokenizer(directory / "_tokenizer")
    shutil.rmtree(directory / "_tokenizer")
    pipe = StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
        scheduler=DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                clip_sample=False, set_alpha_to_one=False, steps_offset=1),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.save_pretrained(directory)
    (directory / "diffserve.json").write_text(json.dumps(DEFAULTS, indent=2) + "\n")
    return {"unet": _param_millions(unet), "vae": _param_millions(vae),
            "text_encoder": _param_millions(text_encoder)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Build a ~30M-parameter random-weight Stable Diffusion pipeline (128x128, "
                    "4 steps) as a diffusers directory that `diffserve serve --model DIR`, "
                    "bench_offline.py and compare.py can load.")
    parser.add_argument("--out", required=True, type=Path, help="Directory to write the pipeline to.")
    parser.add_argument("--force", action="store_true",
                        help="Replace --out if it already exists.")
    parser.add_argument("--unet-channels", default="96,192,384",
                        help="UNet block widths, comma-separated (multiples of 32). The default "
                             "gives about 30M UNet parameters. Default: %(default)s.")
    parser.add_argument("--seed", type=int, default=0, help="Weight seed. Default: %(default)s.")
    args = parser.parse_args(argv)

    try:
        channels = tuple(int(c) for c in args.unet_channels.split(","))
    except ValueError:
        parser.error(f"--unet-channels {args.unet_channels!r} is not a comma-separated list of ints")
    if len(channels) < 2 or any(c <= 0 or c % 32 for c in channels):
        parser.error("--unet-channels needs at least two positive multiples of 32")
    out: Path = args.out.expanduser()
    occupied = any(out.iterdir()) if out.is_dir() else out.exists()
    if occupied and not args.force:
        print(f"models.py: {out} exists; pass --force to replace it", file=sys.stderr)
        return 1
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target and rename, so a reader never sees a half-written model.
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        counts = build_mid_sd(staging, channels, args.seed)
        staging.chmod(0o755)  # mkdtemp makes it private
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    total = sum(counts.values())
    parts = ", ".join(f"{name} {m:.1f}M" for name, m in counts.items())
    print(f"wrote {out} ({parts}; {total:.1f}M parameters in all)")
    print(f"serve it with: diffserve serve --model {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
