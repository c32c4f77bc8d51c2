"""Train the ``shapes`` model from scratch on CPU and save it as a diffusers pipeline.

Two stages, both on images drawn by :mod:`tools.shapes.data` from the training
combinations only (the held-out ones are never drawn):

1. an autoencoder (AutoencoderKL, 32x32x3 pixels <-> 8x8x4 latents), trained on reconstruction
   (MSE + 0.1 L1 + a tiny KL term); its latent scaling factor is set to 1 / latent std;
2. the UNet and the CLIP text encoder together, from scratch, on the cached latents of the
   training images: v-prediction on a 1000-step linear noise schedule, min-SNR-5 loss weights,
   10% blank prompts (for classifier-free guidance), AdamW with warm-up and cosine decay,
   gradient clipping and an exponential moving average of the weights (which is what is saved).

Usage::

    python -m tools.shapes.train --out DIR [--dtype float16]

The defaults are the settings of the shipped model (about 25 minutes on 2 CPU cores). The run
is seeded: the same flags give the same data, initial weights and noise.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
from pathlib import Path

import numpy as np

from tools.shapes import data

MAX_TOKENS = 48


def build_vae(image_size: int = data.IMAGE_SIZE, latent_channels: int = 4,
              channels: tuple[int, ...] = (32, 64, 64)):
    from diffusers import AutoencoderKL

    # Three levels: 4x spatial downsampling (32x32 pixels -> 8x8 latents).
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=latent_channels, block_out_channels=tuple(channels),
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
        layers_per_block=1, norm_num_groups=8, sample_size=image_size)


def build_text_encoder():
    from transformers import CLIPTextConfig, CLIPTextModel

    return CLIPTextModel(CLIPTextConfig(
        vocab_size=514, hidden_size=64, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=4, max_position_embeddings=MAX_TOKENS, bos_token_id=512,
        eos_token_id=513, pad_token_id=513, projection_dim=64))


def build_unet(latent_size: int, latent_channels: int = 4):
    from diffusers import UNet2DConditionModel

    # Cross-attention at both levels (8x8 and 4x4 latents) and in the middle block.
    # ``attention_head_dim`` is, for this class, the number of heads: 8 heads at every level.
    return UNet2DConditionModel(
        sample_size=latent_size, in_channels=latent_channels, out_channels=latent_channels, layers_per_block=1,
        block_out_channels=(64, 128), down_block_types=("CrossAttnDownBlock2D",) * 2,
        up_block_types=("CrossAttnUpBlock2D",) * 2, cross_attention_dim=64,
        attention_head_dim=8, norm_num_groups=32)


def noise_schedule_config() -> dict:
    return dict(num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02,
                beta_schedule="linear", prediction_type="v_prediction")


def make_scheduler():
    from diffusers import DPMSolverMultistepScheduler

    # steps_offset=1 only to match what StableDiffusionPipeline expects of any scheduler; with
    # "linspace" timestep spacing it changes nothing.
    return DPMSolverMultistepScheduler(**noise_schedule_config(), algorithm_type="dpmsolver++",
                                       solver_order=2, steps_offset=1)


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.02) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def _log(message: str, log_file: Path | None) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {message}"
    print(line, flush=True)
    if log_file is not None:
        with log_file.open("a") as f:
            f.write(line + "\n")


def train_vae(torch, images: "torch.Tensor", steps: int, batch: int, lr: float, seed: int, log,
              latent_channels: int = 4, channels: tuple[int, ...] = (32, 64, 64)):
    vae = build_vae(images.shape[-1], latent_channels, channels)
    optimiser = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.01)
    generator = torch.Generator().manual_seed(seed)
    vae.train()
    started = time.perf_counter()
    for step in range(steps):
        for group in optimiser.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup=min(50, steps // 10 + 1))
        x = images[torch.randint(len(images), (batch,), generator=generator)]
        posterior = vae.encode(x).latent_dist
        # The mean is decoded, not a sample: sampling noise in training makes the decoder blur
        # edges (and so round off corners), and the pipeline only ever decodes what the UNet made.
        recon = vae.decode(posterior.mean).sample
        mse = (recon - x).pow(2).mean()
        l1 = (recon - x).abs().mean()
        kl = posterior.kl().mean()
        loss = mse + 0.1 * l1 + 1e-6 * kl
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimiser.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"vae step {step:5d}/{steps} mse {mse.item():.5f} l1 {l1.item():.4f} "
                f"kl {kl.item():.1f} ({time.perf_counter() - started:.0f}s)")
    vae.eval()
    return vae


def encode_latents(torch, vae, images: "torch.Tensor", batch: int = 256) -> "torch.Tensor":
    out = []
    with torch.no_grad():
        for start in range(0, len(images), batch):
            out.append(vae.encode(images[start:start + batch]).latent_dist.mean)
    return torch.cat(out)


def check_vae(torch, vae, combos, seed: int, count: int = 240, grid: Path | None = None) -> dict:
    """Shape and colour accuracy of ``classify`` on autoencoder round trips of fresh images;
    the ones it misreads go to ``grid`` (a PNG) if given."""
    from tools.shapes.evaluate import make_grid, parse_prompt, score_images

    pixels, prompts, _ = data.make_dataset(count, combos, seed=seed + 99)
    x = torch.from_numpy(pixels).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)
    with torch.no_grad():
        recon = vae.decode(vae.encode(x).latent_dist.mean).sample
    recon = ((recon.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    result = score_images(recon, prompts)
    if grid is not None:
        wrong = [i for i, (p, got) in enumerate(zip(prompts, result["predictions"]))
                 if parse_prompt(p) != got]
        if wrong:
            pairs = [j for i in wrong[:24] for j in (i, i)]
            both = np.stack([pixels[i] if k % 2 == 0 else recon[i] for k, i in enumerate(pairs)])
            make_grid(both, [prompts[i] for i in pairs], columns=8).save(grid)
    result["mse"] = float(((recon.astype(np.float32) - pixels) / 127.5).__pow__(2).mean())
    return {k: result[k] for k in ("mse", "colour_accuracy", "shape_accuracy", "shape_accuracy_by_shape")}


def train_denoiser(torch, latents: "torch.Tensor", token_ids: "torch.Tensor", blank_ids: "torch.Tensor",
                   steps: int, batch: int, lr: float, warmup: int, ema_decay: float,
                   blank_fraction: float, min_snr: float, seed: int, log,
                   probe=None, probe_every: int = 0):
    """Train UNet + text encoder; returns them holding their EMA weights. Every ``probe_every``
    steps, ``probe(unet, text_encoder)`` is called with the EMA weights loaded (then restored)."""
    from diffusers import DDPMScheduler

    torch.manual_seed(seed)
    unet = build_unet(latents.shape[-1], latents.shape[1])
    text_encoder = build_text_encoder()
    modules = (unet, text_encoder)
    params = [p for m in modules for p in m.parameters()]
    ema = [p.detach().clone() for p in params]
    optimiser = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, betas=(0.9, 0.99))
    schedule = DDPMScheduler(**noise_schedule_config())
    alphas_cumprod = schedule.alphas_cumprod.float()
    snr_all = alphas_cumprod / (1 - alphas_cumprod)
    generator = torch.Generator().manual_seed(seed + 1)
    unet.train()
    text_encoder.train()
    order = torch.randperm(len(latents), generator=generator)
    cursor = 0
    started = time.perf_counter()
    running = 0.0
    for step in range(steps):
        if cursor + batch > len(order):
            order, cursor = torch.randperm(len(latents), generator=generator), 0
        index = order[cursor:cursor + batch]
        cursor += batch
        for group in optimiser.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        x0 = latents[index]
        ids = token_ids[index].clone()
        blank = torch.rand(batch, generator=generator) < blank_fraction
        ids[blank] = blank_ids
        t = torch.randint(0, schedule.config.num_train_timesteps, (batch,), generator=generator)
        noise = torch.randn(x0.shape, generator=generator)
        a = alphas_cumprod[t].sqrt().view(-1, 1, 1, 1)
        s = (1 - alphas_cumprod[t]).sqrt().view(-1, 1, 1, 1)
        noisy = a * x0 + s * noise
        target = a * noise - s * x0
        hidden = text_encoder(ids)[0]
        prediction = unet(noisy, t, hidden).sample
        snr = snr_all[t]
        # min-SNR-gamma weights for a v-prediction target: min(snr, gamma) / (snr + 1).
        weight = torch.clamp(snr, max=min_snr) / (snr + 1)
        per_sample = (prediction - target).pow(2).mean(dim=(1, 2, 3))
        loss = (weight * per_sample).mean()
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimiser.step()
        decay = min(ema_decay, (1 + step) / (10 + step))
        with torch.no_grad():
            torch._foreach_lerp_(ema, [p.detach() for p in params], 1 - decay)
        running = loss.item() if step == 0 else 0.98 * running + 0.02 * loss.item()
        if step % 100 == 0 or step == steps - 1:
            elapsed = time.perf_counter() - started
            log(f"unet step {step:5d}/{steps} loss {running:.4f} lr {optimiser.param_groups[0]['lr']:.2e} "
                f"({elapsed:.0f}s, {elapsed / (step + 1):.2f}s/step, cpu {time.process_time():.0f}s)")
        if probe is not None and probe_every and (step + 1) % probe_every == 0 and step + 1 < steps:
            with torch.no_grad():
                saved = [p.detach().clone() for p in params]
                for p, e in zip(params, ema):
                    p.copy_(e)
                unet.eval()
                text_encoder.eval()
                probe(unet, text_encoder)
                for p, w in zip(params, saved):
                    p.copy_(w)
                unet.train()
                text_encoder.train()
    with torch.no_grad():
        for p, e in zip(params, ema):
            p.copy_(e)
    unet.eval()
    text_encoder.eval()
    return unet, text_encoder


def build_pipeline(vae, unet, text_encoder, tokenizer):
    from diffusers import StableDiffusionPipeline

    return StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
        scheduler=make_scheduler(), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False)


def save_pipeline(pipe, out: Path, dtype: str, defaults: dict) -> None:
    import torch

    if dtype == "float16":
        pipe.to(torch.float16)
    pipe.save_pretrained(out, safe_serialization=True)
    if dtype == "float16":
        pipe.to(torch.float32)
    (out / "diffserve.json").write_text(json.dumps(defaults, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Train the shapes text-to-image model from scratch on CPU.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="pipeline directory to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--num-images", type=int, default=30000,
                        help="training images drawn (and their latents cached) once")
    parser.add_argument("--latent-channels", type=int, default=4)
    parser.add_argument("--vae-channels", type=lambda v: tuple(int(c) for c in v.split(",")),
                        default=(32, 64, 64), help="autoencoder widths, one per level")
    parser.add_argument("--vae", type=Path, default=None,
                        help="reuse the autoencoder of this pipeline directory (skips stage 1)")
    parser.add_argument("--stop-after-vae", action="store_true",
                        help="train and check the autoencoder only (saved to OUT/vae)")
    parser.add_argument("--vae-steps", type=int, default=800)
    parser.add_argument("--vae-batch", type=int, default=64)
    parser.add_argument("--vae-lr", type=float, default=2e-3)
    parser.add_argument("--steps", type=int, default=2600, help="UNet + text encoder steps")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--ema", type=float, default=0.998, help="EMA decay of the saved weights")
    parser.add_argument("--blank-fraction", type=float, default=0.1,
                        help="share of blank prompts (classifier-free guidance)")
    parser.add_argument("--min-snr", type=float, default=5.0, help="min-SNR-gamma loss weighting")
    parser.add_argument("--dtype", choices=("float32", "float16"), default="float16",
                        help="dtype of the saved weights")
    parser.add_argument("--steps-default", type=int, default=20,
                        help="num_inference_steps written to diffserve.json")
    parser.add_argument("--guidance-default", type=float, default=4.0,
                        help="guidance_scale written to diffserve.json")
    parser.add_argument("--probe-every", type=int, default=0,
                        help="also score the EMA weights on the held-out prompts (one image "
                             "each) every this many steps (0: never)")
    parser.add_argument("--eval-repeats", type=int, default=2,
                        help="score the result on the held-out prompts, this many images each "
                             "(0: skip)")
    args = parser.parse_args(argv)

    import torch

    from diffserve.builders.tokenizers import write_byte_clip_tokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    log_file = args.out / "train.log"
    log_file.unlink(missing_ok=True)

    def log(message: str) -> None:
        _log(message, log_file)

    started = time.perf_counter()
    train_combos, held_out = data.split_combos()
    log(f"{len(train_combos)} training combinations, {len(held_out)} held out; "
        f"drawing {args.num_images} images")
    pixels, prompts, _ = data.make_dataset(args.num_images, train_combos, seed=args.seed)
    images = torch.from_numpy(pixels).permute(0, 3, 1, 2).float().div(127.5).sub(1.0).contiguous()

    if args.vae is not None:
        from diffusers import AutoencoderKL

        vae = AutoencoderKL.from_pretrained(args.vae / "vae", torch_dtype=torch.float32).eval()
        log(f"autoencoder loaded from {args.vae}")
    else:
        vae = train_vae(torch, images, args.vae_steps, args.vae_batch, args.vae_lr, args.seed, log,
                        args.latent_channels, args.vae_channels)
    latents = encode_latents(torch, vae, images)
    scaling = 1.0 / latents.std().item()
    vae.register_to_config(scaling_factor=scaling)
    latents = (latents * scaling).contiguous()
    log(f"cached {tuple(latents.shape)} latents, scaling factor {scaling:.4f} "
        f"({time.perf_counter() - started:.0f}s)")
    log("autoencoder round trip of held-out images: " + json.dumps(
        check_vae(torch, vae, held_out, args.seed, grid=args.out / "vae_misread.png")))
    if args.stop_after_vae:
        vae.save_pretrained(args.out / "vae")
        return

    tok_dir = args.out / "_tokenizer_tmp"
    tokenizer = write_byte_clip_tokenizer(tok_dir, max_length=MAX_TOKENS)
    shutil.rmtree(tok_dir, ignore_errors=True)
    unique = sorted(set(prompts))
    encoded = tokenizer(unique + [""], padding="max_length", max_length=MAX_TOKENS,
                        truncation=True, return_tensors="pt").input_ids
    row = {p: i for i, p in enumerate(unique)}
    token_ids = encoded[torch.tensor([row[p] for p in prompts])]
    blank_ids = encoded[-1]

    def probe(unet, text_encoder) -> None:
        from tools.shapes.evaluate import evaluation_prompts, score

        pipe = build_pipeline(vae, unet, text_encoder, tokenizer)
        pipe.set_progress_bar_config(disable=True)
        result = score(pipe, evaluation_prompts(1), num_inference_steps=args.steps_default,
                       guidance_scale=args.guidance_default)
        log(f"probe: colour {result['colour_accuracy']:.3f} shape {result['shape_accuracy']:.3f} "
            f"by shape {result['shape_accuracy_by_shape']}")

    unet, text_encoder = train_denoiser(
        torch, latents, token_ids, blank_ids, args.steps, args.batch, args.lr, args.warmup,
        args.ema, args.blank_fraction, args.min_snr, args.seed, log, probe, args.probe_every)
    train_seconds = time.perf_counter() - started
    log(f"training done in {train_seconds / 60:.1f} min (process cpu {time.process_time() / 60:.1f} min)")

    pipe = build_pipeline(vae, unet, text_encoder, tokenizer)
    pipe.set_progress_bar_config(disable=True)
    defaults = {"width": data.IMAGE_SIZE, "height": data.IMAGE_SIZE, "spatial_stride": 8,
                "num_inference_steps": args.steps_default, "guidance_scale": args.guidance_default}
    save_pipeline(pipe, args.out, args.dtype, defaults)
    log(f"saved to {args.out} ({args.dtype})")

    if args.eval_repeats:
        from tools.shapes.evaluate import evaluation_prompts, score

        result = score(pipe, evaluation_prompts(args.eval_repeats),
                       num_inference_steps=args.steps_default, guidance_scale=args.guidance_default)
        result.pop("predictions")
        log("held-out score: " + json.dumps(result))


if __name__ == "__main__":
    main()
