"""The suite split between pytest-xdist workers in fixed shares.

Most of a test run is processes: servers starting (an executor imports torch and diffusers on
one core), long background runs, and tests computing references in the pytest process itself on
one core. One pytest process leaves the second core idle whenever its own work is the only work;
two keep both busy. Each worker must know, when collection ends, which tests it will run and in
what order: it launches their servers ahead (``server.Launches``) and starts their background
runs (``background.py``). xdist's own schedulers hand tests out as workers ask, so
:class:`FixedShares` gives each worker its share up front instead: whole files (a module's
server starts once), balanced by :data:`SECONDS`, each share in collection order.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

# Seconds each file's tests took (setup, call and teardown, as --durations=0 reports them) in a
# two-worker run on a 2-core machine (files not listed: DEFAULT_S).
# Only the balance of the shares depends on these; a stale figure costs time, never a test.
SECONDS = {
    "tests/test_benchmarks_smoke.py": 127, "tests/test_reliability.py": 75,
    "tests/test_parallel_groups.py": 48, "tests/frontend/test_videos.py": 45,
    "tests/test_adapters.py": 43, "tests/test_data_parallel.py": 37, "tests/test_step_mode.py": 32,
    "tests/executor/test_flux2.py": 27, "tests/executor/test_process.py": 27,
    "tests/executor/test_compiled.py": 23, "tests/test_rollouts.py": 23,
    "tests/executor/test_adapters.py": 21, "tests/frontend/test_edits_and_streaming.py": 20,
    "tests/executor/test_adapter_families.py": 19, "tests/executor/test_qwen_image_edit.py": 19,
    "tests/test_soak.py": 19, "tests/executor/test_step_engine.py": 17,
    "tests/executor/test_adapter_rows.py": 16, "tests/executor/test_memory.py": 16,
    "tests/test_weight_updates.py": 14, "tests/test_server_e2e.py": 13,
    "tests/models/test_shapes_serving.py": 12, "tests/executor/test_half_precision.py": 10,
    "tests/frontend/test_video_playground.py": 10, "tests/test_prometheus.py": 10,
    "tests/frontend/test_fuzz.py": 9, "tests/executor/test_self_check.py": 8,
    "tests/executor/test_step_cache.py": 8, "tests/models/test_embedded.py": 8,
    "tests/models/test_shapes.py": 8, "tests/test_non_finite.py": 7,
    "tests/executor/test_dit_families.py": 6, "tests/scheduler/test_process.py": 6,
    "tests/test_accelerators_server.py": 6, "tests/test_calibrate.py": 6,
    "tests/frontend/test_playground.py": 5, "tests/test_task_checks.py": 5,
    "tests/executor/test_quantization.py": 4, "tests/executor/test_request_runner.py": 4,
    "tests/executor/test_stages.py": 4, "tests/executor/test_z_image_chroma.py": 4,
    "tests/test_client.py": 4, "tests/test_config.py": 4, "tests/test_instruction_edits.py": 4,
    "tests/test_memory_server.py": 3, "tests/test_priorities.py": 2,
    # Its tests take their results from the Ray application's background run, which has ended
    # by the time they come (it keeps both cores' share busy from the session's start instead).
    "tests/test_ray.py": 2,
}
DEFAULT_S = 1.0


def shares(nodeids: Sequence[str], count: int) -> list[list[int]]:
    """The indices of ``nodeids`` each of ``count`` workers runs: each file goes whole to the
    least loaded worker, the heaviest first (ties by name), and each share keeps its order."""
    files = list(dict.fromkeys(nodeid.split("::", 1)[0] for nodeid in nodeids))
    load = [0.0] * count
    owner: dict[str, int] = {}
    for file in sorted(files, key=lambda f: (-SECONDS.get(f, DEFAULT_S), f)):
        worker = min(range(count), key=lambda w: (load[w], w))
        owner[file] = worker
        load[worker] += SECONDS.get(file, DEFAULT_S)
    found: list[list[int]] = [[] for _ in range(count)]
    for index, nodeid in enumerate(nodeids):
        found[owner[nodeid.split("::", 1)[0]]].append(index)
    return found


def worker_index(name: str) -> int:
    """The index in an xdist worker's name (``gw0``, ``gw1``...), its share's index."""
    return int(name.removeprefix("gw"))


def this_worker() -> tuple[int, int] | None:
    """(index, count) of this xdist worker; None in a pytest process that runs every test."""
    name = os.environ.get("PYTEST_XDIST_WORKER")
    if not name:
        return None
    return worker_index(name), int(os.environ["PYTEST_XDIST_WORKER_COUNT"])


def mine(items: list) -> list:
    """The collected ``items`` this process runs, in order."""
    worker = this_worker()
    if worker is None:
        return items
    index, count = worker
    return [items[i] for i in shares([item.nodeid for item in items], count)[index]]


def scheduler(config, log):
    """xdist's scheduler for this suite (the ``pytest_xdist_make_scheduler`` hook)."""
    from xdist.scheduler import EachScheduling

    class FixedShares(EachScheduling):
        """Each worker runs its share of the collection (:func:`shares`), sent whole at the
        start. A worker that replaces a crashed one runs what the crashed one had left."""

        def schedule(self) -> None:
            assert self.collection_is_completed
            for node, pending in self.node2pending.items():
                if node in self._started:
                    continue
                if not pending:
                    index = worker_index(node.gateway.id)
                    pending[:] = shares(self.node2collection[node], self.numnodes)[index]
                if pending:
                    node.send_runtest_some(list(pending))
                node.shutdown()
                self._started.append(node)

    return FixedShares(config, log)
