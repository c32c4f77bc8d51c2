"""Video jobs on a Wan model through the Videos API, end to end against ``diffserve serve`` in step mode.

``--jobs`` jobs created at once (sharing the running set) against one at a time, alternating
``--rounds`` times on one server: jobs/s from the first create to the last MP4 (medians). Each MP4
is checked against the plain pipeline alone (PSNR), and so are the step engine's frames for the
same requests admitted together in this process (within 2/255).

    python benchmarks/bench_video.py jobs --model tiny-wan
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
import warnings

import kit
from diffserve.protocol import ImageRequest, WorkItem

warnings.filterwarnings("ignore", category=DeprecationWarning)  # the SDK's Videos API


def jobs(args) -> dict:
    from openai import OpenAI

    bodies = [dict(prompt=f"video {i}", size=args.size, extra_body={
        "seed": 100 + i, "num_frames": args.frames, "num_inference_steps": args.steps}) for i in range(args.jobs)]
    rounds: dict[str, list[float]] = {"concurrent": [], "sequential": []}
    bounds = ("--max-batch-cost", args.max_batch_cost) if args.max_batch_cost else ()
    # One intra-op thread unless --torch-threads says more, as the project's test servers run.
    with kit.server("--model", args.model, "--torch-threads", args.torch_threads, "--batching-mode", "step",
                    *bounds, env={"OMP_NUM_THREADS": "1"}) as server:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)

        def wait(video_id):
            while (video := client.videos.retrieve(video_id)).status not in ("completed", "failed"):
                time.sleep(0.01)
            assert video.status == "completed", video
            return video

        runs = {"concurrent": lambda: [wait(v.id) for v in [client.videos.create(**b) for b in bodies]],
                "sequential": lambda: [wait(client.videos.create(**b).id) for b in bodies]}
        runs["concurrent"]()  # warm-up
        for _ in range(args.rounds):
            for name, run in runs.items():
                start = time.perf_counter()
                made = run()
                rounds[name].append(args.jobs / (time.perf_counter() - start))
        psnr = min(mp4_psnr(args, client.videos.download_content(v.id).read(), b) for v, b in zip(made, bodies))
    medians = {name: statistics.median(values) for name, values in rounds.items()}
    return {"jobs_per_s": medians, "rounds": rounds, "ratio": medians["concurrent"] / medians["sequential"],
            "worst_mp4_psnr_db": psnr, "worst_engine_diff": engine_diff(args, bodies)}


def request(args, body: dict, request_id: str = "ref") -> ImageRequest:
    (width, height), extra = map(int, args.size.split("x")), body["extra_body"]
    return ImageRequest(request_id, args.model, width, height, num_inference_steps=extra["num_inference_steps"],
                        guidance_scale=5.0, prompt=body["prompt"], seed=extra["seed"], num_frames=extra["num_frames"])


def mp4_psnr(args, data: bytes, body: dict) -> float:
    from diffserve.frontend.videos.encode import decode_mp4

    with tempfile.NamedTemporaryFile(suffix=".mp4") as f:
        f.write(data)
        f.flush()
        frames = decode_mp4(f.name)
    return kit.psnr(frames, kit.reference(args.model, args.torch_threads, True).images(request(args, body))[0])


def engine_diff(args, bodies) -> int:
    """The step engine's frames for the jobs admitted together, against the pipeline alone."""
    from diffserve.executor.families import family_for
    from diffserve.executor.step_engine import StepEngine

    ref = kit.reference(args.model, args.torch_threads, True)
    engine = StepEngine(family_for(ref.loaded.pipeline_class)(ref.loaded.pipe, ref.pipelines, ref.loaded.call_kwargs))
    requests = [request(args, body, f"j{i}") for i, body in enumerate(bodies)]
    engine.admit([WorkItem(r, 0, 1) for r in requests], [[] for _ in requests])
    made = {}
    while engine:
        made.update((o.item.request.request_id, o.images) for o in engine.step().finished)
    return max(ref.diff(made[r.request_id], ref.images(r)) for r in requests)


def main(argv=None) -> int:
    p = kit.parser(__doc__, model="tiny-wan", size="32x32", steps=20, rounds=3, torch_threads=2, output_file=None)
    p.add_argument("scenario", nargs="?", choices=("jobs",), default="jobs")
    p.add_argument("--jobs", type=kit.count, default=4)
    p.add_argument("--frames", type=int, default=9)
    p.add_argument("--max-batch-cost", type=float, default=0, help="The server's (0: its default).")
    args = p.parse_args(argv)
    result = {"scenario": args.scenario, "model": args.model, "size": args.size, "frames": args.frames,
              **jobs(args), "machine": kit.machine()}
    print(json.dumps(result, indent=1))
    kit.write_json(args.output_file, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
