"""The model FLOPs count at real size, on the meta device (no weight made, no arithmetic done):
FLUX.1-dev, Qwen-Image and Wan 2.1 14B's denoisers built from their published configs
(``random:NAME``), one forward counted by torch's FLOP counter (attention on the math kernel,
as the server's fit counts it) at each size, against (a) the quadratic fitted from three small
sizes, as every executor fits it at start (diffserve.executor.accel.flops), and (b) the hand
model of bench_parallel.py (per-token linear layers and attention only).

    python benchmarks/bench_flops.py
"""

from __future__ import annotations

import sys

import numpy as np

import bench_parallel
from kit import cli, stats
from diffserve.builders.registry import resolve_model

TEXT = 512  # text tokens (T5's padded length; a long Qwen-Image prompt)


def flux_inputs(torch, cfg, side: int) -> dict:
    n = (side // 16) ** 2
    return dict(hidden_states=torch.zeros(1, n, cfg["in_channels"]),
                encoder_hidden_states=torch.zeros(1, TEXT, cfg["joint_attention_dim"]),
                pooled_projections=torch.zeros(1, cfg["pooled_projection_dim"]),
                timestep=torch.zeros(1), guidance=torch.zeros(1), img_ids=torch.zeros(n, 3),
                txt_ids=torch.zeros(TEXT, 3), return_dict=False)


def qwen_inputs(torch, cfg, side: int) -> dict:
    n, grid = (side // 16) ** 2, side // 16
    return dict(hidden_states=torch.zeros(1, n, cfg["in_channels"]),
                encoder_hidden_states=torch.zeros(1, TEXT, cfg["joint_attention_dim"]),
                encoder_hidden_states_mask=None, timestep=torch.zeros(1),
                img_shapes=[[(1, grid, grid)]], return_dict=False)


def wan_inputs(torch, cfg, side: int) -> dict:  # side: the width; 9:16, 81 frames (21 latent)
    return dict(hidden_states=torch.zeros(1, cfg["in_channels"], 21, side * 9 // 128, side // 8),
                encoder_hidden_states=torch.zeros(1, TEXT, cfg["text_dim"]),
                timestep=torch.zeros(1), return_dict=False)


# name: (random: model, the denoiser's inputs at a size, its tokens (after patching) at a size,
# bench_parallel's shape, the fit's three sizes: whole patches, as an executor's fit takes them)
MODELS = {"FLUX.1-dev": ("random:flux.1-dev", flux_inputs, lambda s: (s // 16) ** 2,
                         bench_parallel.REAL["FLUX.1-dev 1024²"], (128, 256, 384)),
          "Qwen-Image": ("random:qwen-image", qwen_inputs, lambda s: (s // 16) ** 2,
                         bench_parallel.REAL["Qwen-Image 1024²"], (128, 256, 384)),
          "Wan 2.1 14B (x 81 frames)": ("random:wan2.1-14b", wan_inputs,
                                       lambda s: 21 * (s * 9 // 256) * (s // 16),
                                       bench_parallel.REAL["Wan 2.1 14B 720p x 81"],
                                       (256, 512, 768))}


def counted(denoiser, inputs: dict) -> int:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    with sdpa_kernel(SDPBackend.MATH), torch.inference_mode(), FlopCounterMode(display=False) as mode:
        denoiser(**inputs)
    return mode.get_total_flops()


def at(torch, inputs_at, cfg, side: int) -> dict:
    """The denoiser's inputs at ``side``, as meta tensors in its dtype."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            return inputs_at(torch, cfg, side)
    finally:
        torch.set_default_dtype(default)


def measure(name: str, sizes: list[int]) -> list[dict]:
    import torch

    from diffserve.builders import random as random_weights

    model, inputs_at, tokens_at, shape, small = MODELS[name]
    built = random_weights.build(resolve_model(model), "meta", torch.bfloat16)
    denoiser = built["transformer"]
    cfg = dict(denoiser.config)
    x = np.array([tokens_at(s) for s in small], dtype=float)
    y = np.array([counted(denoiser, at(torch, inputs_at, cfg, s)) for s in small], dtype=float)
    a, b, c = np.linalg.solve(np.stack([np.ones_like(x), x, x * x], axis=1), y)
    rows = []
    for side in sizes:
        tokens, flops = tokens_at(side), counted(denoiser, at(torch, inputs_at, cfg, side))
        blocks, d, heads, ffn, _, _, joint, out, _ = shape
        hand = bench_parallel.model(blocks, d, heads, ffn, tokens, TEXT, joint, out)["flops"]
        rows.append({"model": name, "size": f"{side}" + ("" if "Wan" in name else "²"),
                     "tokens": tokens, "counted TFLOP": flops / 1e12,
                     "fit ÷ counted": f"{(a + b * tokens + c * tokens * tokens) / flops:.5f}",
                     "hand model ÷ counted": f"{hand / flops:.4f}"})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__, output_file=None)
    p.add_argument("--sizes", type=lambda t: [int(v) for v in t.split(",")], default=[512, 1024, 1280],
                   help="Image sides (Wan: the video's width, its height 9/16 of it, 81 frames).")
    p.add_argument("--models", type=cli.names, default=list(MODELS))
    args = p.parse_args(argv)
    rows = [row for name in args.models for row in measure(name, args.sizes)]
    shown = stats.table(rows)
    return cli.done(args, {"rows": rows, **cli.machine()}, shown, 0)


if __name__ == "__main__":
    sys.exit(main())
