"""Random LoRA adapters for any model the server loads, written offline as diffusers LoRA files
(``save_lora_weights``), so that tests and benchmarks exercise the same loader a user's file goes
through. Their B matrices are random, not zero, so each one visibly changes images.

    python -m diffserve.builders.random.loras --model tiny-sd --out /tmp/loras --rank 8 --count 4 [--text-encoder]
    python -m diffserve.builders.random.loras --model tiny-sd --out /tmp/loras --kohya      # the kohya/A1111 layout
"""

from __future__ import annotations

import argparse
from pathlib import Path

# Attention projections of the denoisers and of the CLIP text encoders.
DENOISER_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
TEXT_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")
CLIP_ENCODERS = ("CLIPTextModel", "CLIPTextModelWithProjection")


def _denoiser(pipe) -> tuple[object, str]:
    unet = getattr(pipe, "unet", None)
    return (unet, "unet") if unet is not None else (pipe.transformer, "transformer")


def write_lora(model: str, path: str | Path, rank: int = 4, seed: int = 0,
               text_encoder: bool = False, weight_scale: float = 1.0,
               targets: tuple[str, ...] = DENOISER_TARGETS, dora: bool = False) -> str:
    """One random adapter of ``model`` (a name ``diffserve models`` lists, or a pipeline dir),
    saved to the directory ``path``. ``text_encoder`` also adapts every CLIP text encoder the
    family's LoRA loader takes (SDXL and SD3: both; SD and Flux: the one). ``weight_scale``
    scales its B matrices (how strongly it changes images at scale 1); ``dora`` makes it a DoRA
    adapter. Returns the path."""
    import inspect

    import torch
    from diffusers import DiffusionPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from diffserve.builders.registry import resolve_model

    pipe = DiffusionPipeline.from_pretrained(resolve_model(model))
    denoiser, key = _denoiser(pipe)
    torch.manual_seed(seed)
    # init_lora_weights=False keeps PEFT's random init of B, which is zero otherwise.
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=list(targets),
                        init_lora_weights=False, use_dora=dora)
    denoiser.add_adapter(config, adapter_name="new")
    layers = {f"{key}_lora_layers": _scaled(get_peft_model_state_dict(denoiser, adapter_name="new"),
                                            weight_scale),
              f"{key}_lora_adapter_metadata": config.to_dict()}
    if text_encoder:
        takes = inspect.signature(type(pipe).save_lora_weights).parameters
        for name in ("text_encoder", "text_encoder_2"):
            encoder = getattr(pipe, name, None)
            if f"{name}_lora_layers" not in takes or type(encoder).__name__ not in CLIP_ENCODERS:
                continue
            text_config = LoraConfig(r=rank, lora_alpha=rank, target_modules=list(TEXT_TARGETS),
                                     init_lora_weights=False)
            encoder.add_adapter(text_config, adapter_name="new")
            layers[f"{name}_lora_layers"] = _scaled(
                get_peft_model_state_dict(encoder, adapter_name="new"), weight_scale)
            layers[f"{name}_lora_adapter_metadata"] = text_config.to_dict()
    Path(path).mkdir(parents=True, exist_ok=True)
    type(pipe).save_lora_weights(str(path), **layers)
    return str(path)


def _scaled(state: dict, factor: float) -> dict:
    return {k: v * factor if "lora_B" in k else v for k, v in state.items()}


def write_kohya(diffusers_lora: str | Path, path: str | Path) -> str:
    """The same Stable Diffusion 1.x adapter in the kohya/A1111 layout (``lora_unet_*`` and
    ``lora_te_*`` keys with ``lora_down``/``lora_up`` and an ``alpha`` each), as one file."""
    import torch
    from safetensors.torch import load_file, save_file

    source = load_file(str(Path(diffusers_lora) / "pytorch_lora_weights.safetensors"))
    out = {}
    for key, tensor in source.items():
        part, _, rest = key.partition(".")
        prefix = {"unet": "lora_unet_", "text_encoder": "lora_te_"}[part]
        module, kind = rest.rsplit(".lora_", 1)
        stem = prefix + module.replace(".", "_")
        out[f"{stem}.lora_{'down' if kind.startswith('A') else 'up'}.weight"] = tensor.contiguous()
        if kind.startswith("A"):
            out[f"{stem}.alpha"] = torch.tensor(float(tensor.shape[0]))  # scale 1, as saved
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(path))
    return str(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-sd")
    p.add_argument("--out", required=True, help="Directory; adapter i goes to OUT/lora-i.")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--count", type=int, default=1)
    p.add_argument("--text-encoder", action="store_true",
                   help="Adapt the CLIP text encoders too (those the family's loader takes).")
    p.add_argument("--weight-scale", type=float, default=1.0)
    p.add_argument("--kohya", action="store_true", help="Also write OUT/lora-i.kohya.safetensors.")
    args = p.parse_args(argv)
    for i in range(args.count):
        path = write_lora(args.model, Path(args.out) / f"lora-{i}", args.rank, seed=i,
                          text_encoder=args.text_encoder, weight_scale=args.weight_scale)
        if args.kohya:
            write_kohya(path, Path(args.out) / f"lora-{i}.kohya.safetensors")
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
