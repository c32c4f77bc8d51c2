"""Video jobs on a Wan model through the Videos API of a step-mode ``diffserve serve``: ``--jobs``
jobs created at once against one at a time (jobs/s, medians of ``--rounds``); each MP4, and the
step engine's frames for the same requests in this process, against the plain pipeline alone.

    python benchmarks/bench_video.py jobs --model tiny-wan
"""

from __future__ import annotations

import sys
import tempfile
import time
import warnings
from pathlib import Path

from openai import OpenAI

from kit import cli, in_process, servers, stats
from diffserve.frontend.videos.encode import decode_mp4

warnings.filterwarnings("ignore", category=DeprecationWarning)  # the SDK's Videos API


def main(argv=None) -> int:
    p = cli.parser(__doc__, model="tiny-wan", size="32x32", steps=20, rounds=3, torch_threads=2, output_file=None)
    p.add_argument("scenario", nargs="?", choices=("jobs",), default="jobs")
    p.add_argument("--jobs", type=cli.count, default=4)
    p.add_argument("--frames", type=int, default=9)
    p.add_argument("--max-batch-cost", type=float, default=0, help="The server's (0: its default).")
    args = p.parse_args(argv)
    rt = in_process.runtime(args.model, args.torch_threads, skip_startup_check=True)  # the engine's own frames
    width, height = map(int, args.size.split("x"))
    its = in_process.items(rt, args.jobs, "job", args.steps, 100, width=width, height=height, num_frames=args.frames)
    bodies = [{"prompt": r.prompt, "size": args.size, "extra_body": {
        "seed": r.seed, "num_frames": r.num_frames, "num_inference_steps": r.num_inference_steps}}
        for r in (item.request for item in its)]
    rounds: dict[str, list[float]] = {"concurrent": [], "sequential": []}
    bounds = ("--max-batch-cost", args.max_batch_cost) if args.max_batch_cost else ()
    # One intra-op thread unless --torch-threads says more, as the project's test servers run.
    with servers.server("--model", args.model, "--torch-threads", args.torch_threads, "--batching-mode", "step",
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
                seconds, made = in_process.timed(run)
                rounds[name].append(args.jobs / seconds)
        folder = Path(tempfile.mkdtemp(prefix="bench-video-"))  # the last round's MP4s
        mp4s = [folder / f"{video.id}.mp4" for video in made]
        for video, path in zip(made, mp4s):
            client.videos.download_content(video.id).write_to_file(path)
    ref = in_process.reference(args.model, args.torch_threads)
    engine = {o.item.request.request_id: o.images for o in in_process.stepped(rt.step_engine(), {0: its})}
    # Each job's frames: from the pipeline alone, the engine's (admitted together), the server's MP4.
    checked = [(ref.images(it.request), engine[it.request.request_id], mp4) for it, mp4 in zip(its, mp4s)]
    medians = {name: stats.median(values) for name, values in rounds.items()}
    result = {"scenario": args.scenario, "model": args.model, "size": args.size, "frames": args.frames,
              "jobs_per_s": medians, "rounds": rounds, "ratio": medians["concurrent"] / medians["sequential"],
              "worst_mp4_psnr_db": min(stats.psnr(decode_mp4(str(mp4)), alone[0]) for alone, _, mp4 in checked),
              "worst_engine_diff": max(ref.diff(made, alone) for alone, made, _ in checked), "machine": cli.machine()}
    return cli.done(args, result, result)


if __name__ == "__main__":
    sys.exit(main())
