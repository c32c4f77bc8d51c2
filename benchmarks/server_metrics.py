"""diffserve's /metrics for the load generator: snapshots parsed with prometheus_client, summed
over one or more servers, and what the change between two snapshots says about a run."""

from __future__ import annotations

import asyncio

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]  # (name, sorted labels) -> value

# Not a metric of the server's: the executors of the servers read, each counted once. Every
# executor's series exist from start-up, so counting them does not depend on whether an executor
# had finished loading when the snapshot was taken (summing its readiness would).
EXECUTORS = ("executors", ())


def parse(text: str, into: Samples | None = None) -> Samples:
    """Every sample of the exposition ``text``, added to ``into`` (a sum over servers)."""
    samples = {} if into is None else into
    executors = set()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            samples[key] = samples.get(key, 0.0) + s.value
            if s.name == "diffserve_executor_ready":
                executors.add(s.labels.get("executor"))
    samples[EXECUTORS] = samples.get(EXECUTORS, 0.0) + len(executors)
    return samples


def total(samples: Samples, name: str, **match: str) -> float | None:
    """Sum of the samples of ``name`` whose labels include ``match``; None if there are none."""
    values = [v for (n, labels), v in samples.items()
              if n == name and all((k, val) in labels for k, val in match.items())]
    return sum(values) if values else None


async def fetch(client: aiohttp.ClientSession, base_urls: list[str]) -> Samples | None:
    """diffserve's metrics summed over ``base_urls`` (each counted once); None if any of them
    has no diffserve /metrics."""
    async def one(url: str) -> str | None:
        try:
            async with client.get(url.rstrip("/") + "/metrics",
                                  timeout=aiohttp.ClientTimeout(total=10)) as response:
                text = await response.text()
                return text if response.status == 200 and "diffserve_batch_size" in text else None
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None

    texts = await asyncio.gather(*(one(url) for url in dict.fromkeys(base_urls)))
    if any(text is None for text in texts):
        return None
    samples: Samples = {}
    for text in texts:
        parse(text, samples)
    return samples


def delta(before: Samples | None, after: Samples | None, duration_s: float,
          client_mean_latency_s: float | None = None) -> dict | None:
    """What the servers did between two snapshots ``duration_s`` apart, and where a request's
    time went given the client's mean latency."""
    if before is None or after is None:
        return None

    def change(name: str, **match: str) -> float | None:
        a = total(after, name, **match)
        return None if a is None else a - (total(before, name, **match) or 0.0)

    def mean(name: str) -> float | None:
        s, count = change(name + "_sum"), change(name + "_count")
        return s / count if s is not None and count else None

    def by_label(name: str, label: str) -> dict[str, float]:
        """The nonzero changes of ``name`` per value of ``label``."""
        values = sorted({dict(labels).get(label) for n, labels in after if n == name} - {None})
        return {v: d for v in values if (d := change(name, **{label: v}))}

    executors = after.get(EXECUTORS) or 1.0
    busy = change("diffserve_executor_busy_seconds_total")
    server = {
        "batching_mode": ",".join(sorted(dict(labels)["mode"] for (n, labels), v in after.items()
                                         if n == "diffserve_batching_mode" and v)),
        "executors": executors,
        "dispatches": change("diffserve_batch_size_count"),
        "dispatches_by_reason": by_label("diffserve_dispatches_total", "reason"),
        "mean_batch_size": mean("diffserve_batch_size"),
        "mean_step_running_images": mean("diffserve_step_running_images"),
        "mean_queue_time_s": mean("diffserve_queue_time_seconds"),
        "mean_batch_execution_s": mean("diffserve_batch_execution_seconds"),
        "mean_request_execution_s": mean("diffserve_request_execution_seconds"),
        "mean_server_latency_s": mean("diffserve_request_latency_seconds"),
        "images_generated": change("diffserve_images_generated_total"),
        "requests_by_status": by_label("diffserve_requests_total", "status"),
        # Share of the run the executors spent computing: what the server loses to its own gaps.
        "executor_busy_fraction": None if busy is None or duration_s <= 0 else busy / duration_s / executors,
        "mean_server_overhead_s": None, "mean_client_and_http_s": None,
    }
    if None not in (client_mean_latency_s, server["mean_server_latency_s"],
                    server["mean_queue_time_s"], server["mean_request_execution_s"]):
        # Per request: the client and HTTP (client latency over the frontend's), and the server's
        # own work besides waiting and computing (validation, IPC, image encoding).
        server["mean_client_and_http_s"] = client_mean_latency_s - server["mean_server_latency_s"]
        server["mean_server_overhead_s"] = (server["mean_server_latency_s"] - server["mean_queue_time_s"]
                                            - server["mean_request_execution_s"])
    return server
