"""What the tools in benchmarks/ share, so that each tool is only its scenario. A tool imports the
modules it uses:

- :mod:`kit.cli`: a tool's arguments (:func:`~kit.cli.parser`), the prompts, its JSON output, the
  machine it ran on, and the report of its rounds;
- :mod:`kit.stats`: medians over rounds, ratios, PSNR, target verdicts, tables;
- :mod:`kit.servers`: a round's servers and load (:class:`~kit.servers.Bench`) and a server-load
  tool's ``main``, its scenario over rounds of fresh servers;
- :mod:`kit.loadgen`: load on the OpenAI images API (:func:`~kit.loadgen.run_load`) and a tool's
  own requests;
- :mod:`kit.server_metrics`: what the servers' /metrics say about a run (two snapshots' delta);
- :mod:`kit.in_process`: the engines in this process (a model built as an executor builds it, its
  work items, a step engine stepped to the end) and the model's plain pipeline alone.

A server-load scenario is a function of a :class:`~kit.servers.Bench`::

    from kit import servers

    def dp2(b: servers.Bench) -> dict:
        with b.servers("dp2", {"--data-parallel-size": 2}) as served:
            return {"img/s, dp2": b.load(served, "dp2", max_concurrency=b.args.concurrency)["images_per_s"]}

    servers.main(__doc__, {"dp2": servers.Scenario(dp2, [("img/s, dp2", ">=", 10.0)])}, num_requests=64,
                 concurrency=16)
"""
