"""Video jobs on a Wan model, two measurements (median of ``--rounds``):

- ``jobs``: the Videos API end to end against ``diffserve serve`` in step mode: ``--jobs``
  text-to-video jobs created at once (they share the running set) against the same jobs one
  at a time; throughput is jobs per second from the first create to the last completion, MP4s
  included. Each job's MP4 is checked against the plain diffusers pipeline alone (PSNR), and
  the engine's own frames for the same requests are checked exact (within 2/255) in-process.
- ``experts``: Wan 2.2's two experts in one running set: one forward of ``--rows`` rows whose
  timesteps all fall to one expert, against the same rows split half and half between the
  experts (two calls): what splitting a forward by expert costs.

    python benchmarks/bench_video.py jobs --model tiny-wan
    python benchmarks/bench_video.py experts --model tiny-wan22
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
warnings.filterwarnings("ignore", category=DeprecationWarning)  # the SDK's Videos API


def jobs(args) -> dict:
    from openai import OpenAI

    from server import Server

    bodies = [dict(prompt=f"video {i}", size=args.size, extra_body={
        "seed": 100 + i, "num_frames": args.frames, "num_inference_steps": args.steps})
        for i in range(args.jobs)]
    rounds: dict[str, list[float]] = {"concurrent": [], "sequential": []}
    bounds = ("--max-batch-cost", str(args.max_batch_cost)) if args.max_batch_cost else ()
    with Server("--torch-threads", str(args.torch_threads), "--batching-mode", "step", *bounds,
                model=args.model) as server:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)

        def wait(video_id):
            while (video := client.videos.retrieve(video_id)).status not in ("completed", "failed"):
                time.sleep(0.01)
            assert video.status == "completed", video
            return video

        def concurrent():
            return [wait(v.id) for v in [client.videos.create(**b) for b in bodies]]

        def sequential():
            return [wait(client.videos.create(**b).id) for b in bodies]

        concurrent()  # warm-up
        for _ in range(args.rounds):
            for name, run in (("concurrent", concurrent), ("sequential", sequential)):
                start = time.perf_counter()
                made = run()
                rounds[name].append(args.jobs / (time.perf_counter() - start))
        psnr = min(mp4_psnr(args, client.videos.download_content(v.id).read(), b)
                   for v, b in zip(made, bodies))
    medians = {name: statistics.median(values) for name, values in rounds.items()}
    return {"jobs_per_s": medians, "rounds": rounds,
            "ratio": medians["concurrent"] / medians["sequential"],
            "worst_mp4_psnr_db": psnr, "worst_engine_diff": engine_diff(args, bodies)}


def reference(args, body: dict):
    from diffserve.executor.families import family_for
    from diffserve.executor.loading import load_model, task_pipelines
    from diffserve.protocol import ImageRequest
    from reference import solo

    if not hasattr(reference, "parts"):
        loaded = load_model(args.model, torch_threads=args.torch_threads)
        reference.parts = loaded, task_pipelines(loaded.pipe, family_for(loaded.pipeline_class))
    width, height = map(int, args.size.split("x"))
    extra = body["extra_body"]
    request = ImageRequest("ref", args.model, width, height, num_inference_steps=extra[
        "num_inference_steps"], guidance_scale=5.0, prompt=body["prompt"], seed=extra["seed"],
        num_frames=extra["num_frames"])
    return request, solo(*reference.parts, request)


def mp4_psnr(args, data: bytes, body: dict) -> float:
    import tempfile

    import numpy as np

    from diffserve.frontend.videos.encode import decode_mp4

    with tempfile.NamedTemporaryFile(suffix=".mp4") as f:
        f.write(data)
        f.flush()
        frames = decode_mp4(f.name)
    expected = reference(args, body)[1][0]
    mse = np.mean((frames.astype(float) - expected.astype(float)) ** 2)
    return float(10 * np.log10(255 ** 2 / mse)) if mse else float("inf")


def engine_diff(args, bodies) -> int:
    """The step engine's frames for the jobs admitted together, against the pipeline alone."""
    import numpy as np

    from diffserve.executor.families import family_for
    from diffserve.executor.step_engine import StepEngine
    from diffserve.protocol import WorkItem

    loaded, pipelines = reference.parts
    family = family_for(loaded.pipeline_class)(loaded.pipe, pipelines, loaded.call_kwargs)
    pairs = [reference(args, body) for body in bodies]
    pairs = [(type(r)(**{**r.__dict__, "request_id": f"j{i}"}), solo)
             for i, (r, solo) in enumerate(pairs)]
    engine = StepEngine(family)
    engine.admit([WorkItem(r, 0, 1) for r, _ in pairs], [[] for _ in pairs])
    made = {}
    while engine:
        for o in engine.step().finished:
            made[o.item.request.request_id] = o.images
    return max(int(np.abs(made[r.request_id].astype(int) - solo.astype(int)).max())
               for r, solo in pairs)


def experts(args) -> dict:
    import torch

    from diffserve.executor.families import family_for
    from diffserve.executor.families.wan import WanConditioning
    from diffserve.executor.loading import load_model, task_pipelines

    loaded = load_model(args.model, torch_threads=args.torch_threads)
    family = family_for(loaded.pipeline_class)(
        loaded.pipe, task_pipelines(loaded.pipe), loaded.call_kwargs)
    assert family.boundary is not None, f"{args.model} has one expert"
    width, height = map(int, args.size.split("x"))
    pipe, rows = loaded.pipe, args.rows
    latents = pipe.prepare_latents(rows, pipe.vae.config.z_dim, height, width, args.frames,
                                   torch.float32, "cpu", torch.Generator().manual_seed(0))
    length = loaded.call_kwargs.get("max_sequence_length", 512)
    embeds = pipe.encode_prompt(["a prompt"] * rows, do_classifier_free_guidance=False,
                                max_sequence_length=length)[0]
    cond = WanConditioning(embeds)
    high = torch.full((rows,), 950.0)
    mixed = torch.cat([torch.full((rows // 2,), 950.0), torch.full((rows - rows // 2,), 500.0)])
    times: dict[str, list[float]] = {"one_expert": [], "split": []}
    with torch.inference_mode():
        for _ in range(2):  # warm-up
            family.forward(latents, mixed, cond, None, width, height)
        # Alternating single forwards, so that a spell of load on the machine hits both alike.
        for _ in range(args.rounds * args.repeats):
            for name, t in (("one_expert", high), ("split", mixed)):
                start = time.perf_counter()
                family.forward(latents, t, cond, None, width, height)
                times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    fastest = {name: min(values) for name, values in times.items()}
    return {"forward_ms": {k: v * 1000 for k, v in medians.items()},
            "fastest_ms": {k: v * 1000 for k, v in fastest.items()},
            "split_over_one": medians["split"] / medians["one_expert"],
            "split_over_one_fastest": fastest["split"] / fastest["one_expert"], "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("scenario", choices=("jobs", "experts"))
    p.add_argument("--model", default=None, help="default: tiny-wan (jobs), tiny-wan22 (experts)")
    p.add_argument("--jobs", type=int, default=4)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--size", default="32x32", help="default: tiny Wan's native size")
    p.add_argument("--frames", type=int, default=9)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--torch-threads", type=int, default=2)
    p.add_argument("--max-batch-cost", type=float, default=0, help="the server's (0: its default)")
    args = p.parse_args(argv)
    args.model = args.model or ("tiny-wan" if args.scenario == "jobs" else "tiny-wan22")
    found = (jobs if args.scenario == "jobs" else experts)(args)
    print(json.dumps({"scenario": args.scenario, "model": args.model, "size": args.size,
                      "frames": args.frames, **found}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
