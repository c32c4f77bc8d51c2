"""The online RL loop's control (--enable-weight-updates): how long a weight update and a wake take,
and whether the rollouts right after an update are as fast as the steady ones.

- ``apply``: a step-mode server of ``--model`` (sd-mid: a 36M-parameter UNet) takes the whole
  denoiser, moved as a training step moves it, ``--updates`` times from disk (a directory in
  diffusers' layout) and as many times from memory (the client's shared-memory transport, the
  write included); then sleeps at level 2 and wakes (the weights read again from the model's
  files, the current version applied). Figures: the median of each, seconds.
- ``rollouts``: a step-mode server of ``--rollout-model`` answers ``--count`` rollout requests
  (n=8) at once, several times; between two such runs an update from memory. Figure: the first
  run after an update over the steady runs' median (images/s). Target: at least 0.9.

    python benchmarks/bench_weights.py apply --rounds 3
    python benchmarks/bench_weights.py rollouts --rounds 3
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import kit
from diffserve.client import Client

AFTER = "img/s first after an update / steady"


def state_of(model: str, seed: int) -> dict:
    import torch

    components = kit.reference(model).loaded.pipe.components
    denoiser = components.get("transformer") or components["unet"]
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.01 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in denoiser.state_dict().items()}


def serve(b: kit.Bench, name: str, **flags):
    b.weights_dir = Path(tempfile.mkdtemp(prefix="bench-weights-"))
    return b.servers(name, {"--batching-mode": "step", "--enable-weight-updates": [],
                            "--weights-dir": str(b.weights_dir), **flags})


def timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def apply(b: kit.Bench) -> dict[str, float | None]:
    from safetensors.torch import save_file

    a, figures = b.args, {"from disk s": [], "from memory s": []}
    with serve(b, "apply") as served, Client(served.urls[0]) as client:
        name = "unet" if "unet" in kit.reference(a.model).loaded.pipe.components else "transformer"
        for i in range(a.updates):
            folder = b.weights_dir / f"step-{i}" / name
            folder.mkdir(parents=True)
            save_file(state_of(a.model, i), str(folder / "diffusion_pytorch_model.safetensors"))
            figures["from disk s"].append(timed(lambda: client.update_weights(path=f"step-{i}")))
            state = state_of(a.model, 100 + i)
            figures["from memory s"].append(timed(lambda: client.update_weights(tensors=state)))
        client.sleep(level=2)
        wake = timed(client.wake_up)
    return {**{k: statistics.median(v) for k, v in figures.items()}, "wake from level 2 s": wake}


def rollouts(b: kit.Bench) -> dict[str, float | None]:
    a, runs = b.args, []
    with serve(b, "rollouts", **{"--model": a.rollout_model, "--max-n": 8,
                                 "--dynamic-batch-max-size": 16}) as served, Client(served.urls[0]) as client:
        prompts = [f"a shape, number {i}" for i in range(a.count)]
        go = lambda: client.rollout(prompts, n=8, num_inference_steps=a.steps or 8)  # noqa: E731
        go()  # warm-up
        for i in range(a.runs):
            if i and i % 2 == 0:
                client.update_weights(tensors=state_of(a.rollout_model, i))
            runs.append((i and i % 2 == 0, 8 * a.count / timed(go)))
    steady = statistics.median(r for after, r in runs if not after)
    return {"img/s steady": steady, AFTER: statistics.median(r for after, r in runs if after) / steady}


def arguments(p) -> None:
    p.add_argument("--updates", type=kit.count, default=3, help="apply: updates from disk and from memory each.")
    p.add_argument("--rollout-model", default="tiny-flux", help="rollouts: the model.")
    p.add_argument("--count", type=kit.count, default=4, help="rollouts: requests (n=8) per run.")
    p.add_argument("--runs", type=kit.count, default=7, help="rollouts: runs; one in two after an update.")
    p.add_argument("--steps", type=int, default=None, help="rollouts: steps (8).")


def main(argv: list[str] | None = None) -> int:
    return kit.main(__doc__, {"apply": kit.Scenario(apply), "rollouts": kit.Scenario(rollouts, [(AFTER, ">=", 0.9)])},
                    argv, arguments, model="sd-mid", rounds=3, torch_threads=0)


if __name__ == "__main__":
    sys.exit(main())
