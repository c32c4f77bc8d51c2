"""The online RL loop's control (--enable-weight-updates) on step-mode servers: ``apply``, how long
an update of the whole denoiser takes from disk and from memory, and a wake from level 2;
``rollouts``, whether the rollouts right after an update are as fast as the steady ones
(docs/benchmark-tools.md).

    python benchmarks/bench_weights.py apply --rounds 3
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from kit import cli, in_process, servers, stats
from diffserve.client import Client

AFTER = "img/s first after an update / steady"


def state_of(model: str, seed: int) -> dict:
    """The model's denoiser state, moved as a training step moves it."""
    components = in_process.reference(model).loaded.pipe.components
    denoiser = components.get("transformer") or components["unet"]
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.01 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in denoiser.state_dict().items()}


def serve(b: servers.Bench, name: str, **flags):
    b.weights_dir = Path(tempfile.mkdtemp(prefix="bench-weights-"))
    return b.servers(name, {"--batching-mode": "step", "--enable-weight-updates": [],
                            "--weights-dir": str(b.weights_dir), **flags})


def apply(b: servers.Bench) -> dict[str, float | None]:
    """``--updates`` updates from disk (diffusers' layout) and as many from memory (the client's
    shared-memory transport, the write included); then a sleep at level 2 and its wake."""
    a, figures = b.args, {"from disk s": [], "from memory s": []}
    with serve(b, "apply") as served, Client(served.urls[0]) as client:
        name = "unet" if "unet" in in_process.reference(a.model).loaded.pipe.components else "transformer"
        for i in range(a.updates):
            folder = b.weights_dir / f"step-{i}" / name
            folder.mkdir(parents=True)
            save_file(state_of(a.model, i), str(folder / "diffusion_pytorch_model.safetensors"))
            figures["from disk s"].append(in_process.timed(lambda i=i: client.update_weights(path=f"step-{i}"))[0])
            state = state_of(a.model, 100 + i)
            figures["from memory s"].append(in_process.timed(lambda s=state: client.update_weights(tensors=s))[0])
        client.sleep(level=2)
        wake = in_process.timed(client.wake_up)[0]
    return {**{k: stats.median(v) for k, v in figures.items()}, "wake from level 2 s": wake}


def rollouts(b: servers.Bench) -> dict[str, float | None]:
    """``--count`` rollout requests (n=8) at once, run after run, an update from memory before
    every other run: the first run after an update over the steady runs' median (images/s)."""
    a, runs = b.args, []
    with serve(b, "rollouts", **{"--model": a.rollout_model, "--max-n": 8,
                                 "--dynamic-batch-max-size": 16}) as served, Client(served.urls[0]) as client:
        prompts = [f"a shape, number {i}" for i in range(a.count)]
        go = lambda: client.rollout(prompts, n=8, num_inference_steps=a.steps or 8)  # noqa: E731
        go()  # warm-up
        for i in range(a.runs):
            if i and i % 2 == 0:
                client.update_weights(tensors=state_of(a.rollout_model, i))
            runs.append((i and i % 2 == 0, 8 * a.count / in_process.timed(go)[0]))
    steady = stats.median([r for after, r in runs if not after])
    return {"img/s steady": steady, AFTER: stats.median([r for after, r in runs if after]) / steady}


def arguments(p) -> None:
    p.add_argument("--updates", type=cli.count, default=3, help="apply: updates from disk and from memory each.")
    p.add_argument("--rollout-model", default="tiny-flux", help="rollouts: the model.")
    p.add_argument("--count", type=cli.count, default=4, help="rollouts: requests (n=8) per run.")
    p.add_argument("--runs", type=cli.count, default=7, help="rollouts: runs; one in two after an update.")
    p.add_argument("--steps", type=int, default=None, help="rollouts: steps (8).")


def main(argv: list[str] | None = None) -> int:
    return servers.main(__doc__, {"apply": servers.Scenario(apply),
                                  "rollouts": servers.Scenario(rollouts, [(AFTER, ">=", 0.9)])},
                        argv, arguments, model="sd-mid", rounds=3, torch_threads=0)


if __name__ == "__main__":
    sys.exit(main())
