"""What the tools in benchmarks/ share, so that each tool is only its scenario; a tool imports the
modules it uses: :mod:`kit.cli` (arguments, prompts, JSON output, the report of rounds),
:mod:`kit.stats` (medians, ratios, PSNR, verdicts, tables), :mod:`kit.servers` (a round's servers
and load, a server-load tool's ``main``), :mod:`kit.loadgen` (load on the OpenAI images API),
:mod:`kit.server_metrics` (two /metrics snapshots' delta) and :mod:`kit.in_process` (the engines
in this process). A server-load scenario is a function of a :class:`~kit.servers.Bench`::

    def dp2(b: servers.Bench) -> dict:
        with b.servers("dp2", {"--data-parallel-size": 2}) as served:
            return {"img/s, dp2": b.load(served, "dp2", max_concurrency=b.args.concurrency)["images_per_s"]}

    servers.main(__doc__, {"dp2": servers.Scenario(dp2, [("img/s, dp2", ">=", 10.0)])}, num_requests=64,
                 concurrency=16)
"""
