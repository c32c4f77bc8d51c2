"""diffserve's Prometheus figures for the load generator: just enough parsing of the exposition
text to take the change between two snapshots, and what that change says about a run (batch
sizes, queue time, executor busy share, where a request's time went)."""

from __future__ import annotations

import asyncio
import re

import aiohttp

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            continue
        name, _, labels, value = match.groups()
        try:
            number = float(value)
        except ValueError:
            continue
        key = tuple(sorted(_LABEL.findall(labels or "")))
        samples[(name, key)] = number
    return samples


def _total(samples: dict, name: str, **match: str) -> float | None:
    """Sum of the samples of ``name`` whose labels include ``match``; None if there are none."""
    values = [v for (n, labels), v in samples.items()
              if n == name and all((k, val) in labels for k, val in match.items())]
    return sum(values) if values else None


async def fetch_metrics(client: aiohttp.ClientSession, base_url: str) -> dict | None:
    """The server's diffserve metrics, or None if it has no /metrics or not ours."""
    try:
        async with client.get(base_url.rstrip("/") + "/metrics",
                              timeout=aiohttp.ClientTimeout(total=10)) as response:
            text = await response.text()
            status = response.status
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None
    if status != 200 or "diffserve_batch_size" not in text:
        return None
    return parse_prometheus(text)


def metrics_delta(before: dict | None, after: dict | None, duration_s: float,
                  client_mean_latency_s: float | None = None) -> dict | None:
    """What the server did between two /metrics snapshots ``duration_s`` apart, and where a
    request's time went given the client's mean latency."""
    if before is None or after is None:
        return None

    def delta(name: str, **match: str) -> float | None:
        a, b = _total(after, name, **match), _total(before, name, **match)
        if a is None:
            return None
        return a - (b or 0.0)

    def mean(name: str) -> float | None:
        total, count = delta(name + "_sum"), delta(name + "_count")
        return total / count if total is not None and count else None

    batches = delta("diffserve_batch_size_count")
    buckets: dict[str, float] = {}
    previous = 0.0
    for (name, labels), value in sorted(
            ((k, v) for k, v in after.items() if k[0] == "diffserve_batch_size_bucket"),
            key=lambda kv: float(dict(kv[0][1]).get("le", "inf").replace("+Inf", "inf"))):
        le = dict(labels).get("le", "+Inf")
        cumulative = value - before.get((name, labels), 0.0)
        if cumulative - previous > 0:
            buckets[le] = cumulative - previous  # batches with size in (previous le, le]
        previous = cumulative
    statuses = sorted({dict(labels).get("status") for (name, labels) in after
                       if name == "diffserve_requests_total"} - {None})
    server = {
        "batches": batches,
        "mean_batch_size": mean("diffserve_batch_size"),
        "batch_size_histogram": buckets,
        "mean_queue_time_s": mean("diffserve_queue_time_seconds"),
        "mean_batch_execution_s": mean("diffserve_batch_execution_seconds"),
        "mean_request_execution_s": mean("diffserve_request_execution_seconds"),
        "batch_execution_total_s": delta("diffserve_batch_execution_seconds_sum"),
        "mean_server_latency_s": mean("diffserve_request_latency_seconds"),
        "images_generated": delta("diffserve_images_generated_total"),
        "requests_by_status": {s: delta("diffserve_requests_total", status=s) for s in statuses},
    }
    if server["batch_execution_total_s"] is not None and duration_s > 0:
        # Share of the run the executor spent in pipeline calls: what the server loses to its
        # own overhead, independent of how fast the model ran this time.
        server["executor_busy_fraction"] = server["batch_execution_total_s"] / duration_s
    if None not in (client_mean_latency_s, server["mean_server_latency_s"],
                    server["mean_queue_time_s"], server["mean_request_execution_s"]):
        # Where a request's time goes, on average, all per request: the client and HTTP (client
        # latency over the frontend's), and the server's own work besides waiting and computing
        # (frontend latency over queue time and the pipeline calls that made its images: IPC,
        # validation, image encoding, and waits between the calls of a split request).
        server["mean_client_and_http_s"] = client_mean_latency_s - server["mean_server_latency_s"]
        server["mean_server_overhead_s"] = (server["mean_server_latency_s"]
                                            - server["mean_queue_time_s"]
                                            - server["mean_request_execution_s"])
    return server
