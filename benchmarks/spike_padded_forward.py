"""Spike: rows of two sizes in one transformer forward, padded, against one forward per size.

For the MM-DiT families (Flux; SD3 is the same shape of computation) an image is a sequence of
latent tokens, so rows of different sizes could share one forward if the shorter sequences are
padded to the longest and masked out of attention (with per-row position ids). This measures what
that costs on this machine, with a Flux transformer built from a config (random weights, no
download) big enough for compute to dominate: the padded forward (with its attention mask) against
the two forwards it would replace, and the padded forward without a mask (a floor: what the extra
tokens cost by themselves). Correctness is not the question here, only cost; the verdict is in
docs/benchmarks.md.

    python benchmarks/spike_padded_forward.py --sizes 512,384 --rows 4,4 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time


def build(hidden_heads: int, head_dim: int, layers: int, single_layers: int):
    import torch
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=layers, num_single_layers=single_layers,
        attention_head_dim=head_dim, num_attention_heads=hidden_heads, joint_attention_dim=256,
        pooled_projection_dim=128, guidance_embeds=False, axes_dims_rope=(8, 28, 28)).eval()


def inputs(model, rows: int, tokens: int, text: int = 64):
    import torch

    g = torch.Generator().manual_seed(rows * 1000 + tokens)
    hidden = model.config.num_attention_heads * model.config.attention_head_dim
    del hidden
    return dict(
        hidden_states=torch.randn(rows, tokens, model.config.in_channels, generator=g),
        encoder_hidden_states=torch.randn(rows, text, model.config.joint_attention_dim, generator=g),
        pooled_projections=torch.randn(rows, model.config.pooled_projection_dim, generator=g),
        timestep=torch.full((rows,), 0.5), img_ids=torch.zeros(tokens, 3),
        txt_ids=torch.zeros(text, 3), return_dict=False)


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="512,384", help="two image sides (pixels; 16 px per token side)")
    p.add_argument("--rows", default="4,4", help="rows of each size")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--single-layers", type=int, default=4)
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    model = build(a.heads, a.head_dim, a.layers, a.single_layers)
    (s1, s2), (r1, r2) = [int(v) for v in a.sizes.split(",")], [int(v) for v in a.rows.split(",")]
    t1, t2 = (s1 // 16) ** 2, (s2 // 16) ** 2
    long, text = max(t1, t2), 64
    with torch.inference_mode():
        a1, a2, both = inputs(model, r1, t1), inputs(model, r2, t2), inputs(model, r1 + r2, long)
        # The padded forward's mask: each row sees the text and its own real image tokens.
        mask = torch.zeros(r1 + r2, 1, text + long, text + long, dtype=torch.bool)
        for row, tokens in enumerate([t1] * r1 + [t2] * r2):
            real = text + tokens
            mask[row, :, :real, :real] = True
            mask[row, :, real:, real:] = torch.eye(long - tokens, dtype=torch.bool)  # pads see themselves
        two = timed(lambda: (model(**a1), model(**a2)), a.repeats)
        padded_masked = timed(lambda: model(**both, joint_attention_kwargs={"attention_mask": mask}),
                              a.repeats)
        padded = timed(lambda: model(**both), a.repeats)
    print(f"Flux transformer {a.heads}x{a.head_dim}, {a.layers}+{a.single_layers} blocks, "
          f"{a.threads} threads; {r1} rows of {s1}px ({t1} tokens) + {r2} rows of {s2}px "
          f"({t2} tokens), {text} text tokens")
    print("| forward | ms | vs two forwards |")
    print("| --- | --- | --- |")
    for name, t in (("two forwards, one per size", two), ("one padded forward, masked", padded_masked),
                    ("one padded forward, no mask (floor)", padded)):
        print(f"| {name} | {1000 * t:.0f} | {t / two:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
