"""What the servers' /metrics say about a run: their samples summed over servers
(:func:`metrics`), and what changed between two snapshots (:func:`metrics_delta`)."""

from __future__ import annotations

import functools
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]  # (name, sorted labels) -> value
# Not a metric of the server's: the executors of the servers read, each counted once. Their series
# exist from start-up, so the count does not depend on whether one had finished loading (its readiness would).
EXECUTORS = ("executors", ())


def parse_metrics(text: str, into: Samples | None = None) -> Samples:
    """Every sample of the exposition ``text``, added to ``into`` (a sum over servers)."""
    samples, executors = {} if into is None else into, set()
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
    values = [v for (n, labels), v in samples.items() if n == name and all(kv in labels for kv in match.items())]
    return sum(values) if values else None


def change(before: Samples, after: Samples, name: str, **match: str) -> float | None:
    """How much :func:`total` of ``name`` grew from ``before`` to ``after``; None if it is in neither."""
    a = total(after, name, **match)
    return None if a is None else a - (total(before, name, **match) or 0.0)


def metrics(*urls: str) -> Samples | None:
    """diffserve's metrics now, summed over ``urls`` (each counted once); None where one has none (naive)."""
    samples: Samples = {}
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy the environment names
    for url in dict.fromkeys(u.rstrip("/") for u in urls):
        try:
            with opener.open(url + "/metrics", timeout=10) as response:
                text = response.read().decode()
        except urllib.error.HTTPError:
            text = ""
        if "diffserve_batch_size" not in text:
            return None
        parse_metrics(text, samples)
    return samples


def metrics_delta(before: Samples | None, after: Samples | None, duration_s: float,
                  client_mean_latency_s: float | None = None) -> dict | None:
    """What the servers did between two snapshots ``duration_s`` apart, and where a request's
    time went given the client's mean latency."""
    if before is None or after is None:
        return None
    grew = functools.partial(change, before, after)

    def mean(name: str) -> float | None:
        s, n = grew(name + "_sum"), grew(name + "_count")
        return s / n if s is not None and n else None

    def by_label(name: str, label: str) -> dict[str, float]:
        """The nonzero changes of ``name`` per value of ``label``."""
        values = sorted({dict(labels).get(label) for n, labels in after if n == name} - {None})
        return {v: d for v in values if (d := grew(name, **{label: v}))}

    executors, busy = after.get(EXECUTORS) or 1.0, grew("diffserve_executor_busy_seconds_total")
    d = {"batching_mode": ",".join(sorted(dict(labels)["mode"] for (n, labels), v in after.items()
                                          if n == "diffserve_batching_mode" and v)),
         "executors": executors, "dispatches": grew("diffserve_batch_size_count"),
         "dispatches_by_reason": by_label("diffserve_dispatches_total", "reason"),
         "mean_batch_size": mean("diffserve_batch_size"),
         "mean_step_running_images": mean("diffserve_step_running_images"),
         "mean_queue_time_s": mean("diffserve_queue_time_seconds"),
         "mean_batch_execution_s": mean("diffserve_batch_execution_seconds"),
         "mean_request_execution_s": mean("diffserve_request_execution_seconds"),
         "mean_server_latency_s": mean("diffserve_request_latency_seconds"),
         "images_generated": grew("diffserve_images_generated_total"),
         "requests_by_status": by_label("diffserve_requests_total", "status"),
         # Share of the run the executors spent computing: what the server loses to its own gaps.
         "executor_busy_fraction": None if busy is None or duration_s <= 0 else busy / duration_s / executors,
         "mean_server_overhead_s": None, "mean_client_and_http_s": None}
    if None not in (client_mean_latency_s, d["mean_server_latency_s"], d["mean_queue_time_s"],
                    d["mean_request_execution_s"]):
        # Per request: the client and HTTP (client latency over the frontend's), and the server's
        # own work besides waiting and computing (validation, IPC, image encoding).
        d["mean_client_and_http_s"] = client_mean_latency_s - d["mean_server_latency_s"]
        d["mean_server_overhead_s"] = (d["mean_server_latency_s"] - d["mean_queue_time_s"]
                                       - d["mean_request_execution_s"])
    return d

