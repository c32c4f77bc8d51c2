"""The suite split between pytest-xdist workers: fixed shares, and a pool for the tail.

Most of a test run is processes: servers starting (an executor imports torch and diffusers on
one core), long background runs, and tests computing references in the pytest process itself on
one core. One pytest process leaves the second core idle whenever its own work is the only work;
two keep both busy. A worker must know, when collection ends, which of its tests need servers
and background runs: it launches those servers ahead (``server.Launches``) and starts those runs
(``background.py``). xdist's own schedulers hand tests out as workers ask, so :class:`Shares`
gives each worker a share of the files that need them up front instead: whole files (a module's
server starts once), balanced by :data:`SECONDS`, each share in collection order.

The files whose tests run in the pytest process alone (:data:`IN_PROCESS`: no server launched
ahead, no background run) are not shared out: each goes whole, heaviest first, to the first
worker down to its last test. Estimates of seconds are off by tens of seconds on a busy machine;
a pool of small files at the end lets both workers finish together anyway.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

# Seconds each file's tests took (setup, call and teardown, as --durations=0 reports them) in a
# two-worker run on a 2-core machine (files in neither table: DEFAULT_S, shared out up front).
# Only the balance of the work depends on these; a stale figure costs time, never a test.
SECONDS = {
    "tests/test_benchmarks_smoke.py": 80, "tests/test_benchmarks_early.py": 20,
    "tests/test_reliability.py": 80,
    "tests/test_parallel_groups.py": 50, "tests/test_adapters.py": 45,
    "tests/frontend/test_videos.py": 42, "tests/test_step_mode.py": 34,
    "tests/test_data_parallel.py": 31, "tests/frontend/test_edits_and_streaming.py": 26,
    "tests/test_rollouts.py": 23, "tests/test_soak.py": 19, "tests/test_server_e2e.py": 13,
    "tests/frontend/test_fuzz.py": 12, "tests/test_weight_updates.py": 12,
    "tests/test_prometheus.py": 11, "tests/frontend/test_video_playground.py": 10,
    "tests/frontend/test_playground.py": 9, "tests/builders/test_shapes_serving.py": 8,
    "tests/test_non_finite.py": 8, "tests/scheduler/test_service.py": 6,
    "tests/test_task_checks.py": 6, "tests/test_accelerators_server.py": 5,
    "tests/test_client.py": 4, "tests/test_config.py": 4, "tests/test_instruction_edits.py": 4,
    "tests/test_priorities.py": 4, "tests/frontend/test_light.py": 2,
    "tests/test_memory_server.py": 2, "tests/builders/test_random.py": 12,
    "tests/test_controlnet_server.py": 20, "tests/test_fill_edits.py": 16,
    "tests/frontend/test_image_api.py": 25, "tests/frontend/test_image_jobs.py": 25,
    # Its tests take their results from the Ray application's background run, which has ended
    # by the time they come (it keeps both cores' share busy from the session's start instead).
    "tests/test_ray.py": 1,
}
# The pool's files (the pytest process alone), with their seconds: the heaviest go first.
IN_PROCESS = {
    "tests/test_gpu_check_smoke.py": 90, "tests/executor/test_entry.py": 23, "tests/executor/test_qwen_image_edit.py": 22,
    "tests/executor/test_controlnet.py": 20, "tests/executor/test_flops.py": 25,
    "tests/executor/test_adapter_families.py": 21, "tests/executor/test_flux2.py": 19,
    "tests/executor/test_adapters.py": 18, "tests/executor/test_compiled.py": 16,
    "tests/executor/test_step_engine.py": 16, "tests/executor/test_adapter_rows.py": 15,
    "tests/executor/test_memory.py": 14, "tests/executor/test_dit_families.py": 12,
    "tests/executor/test_flux_fill.py": 10,
    "tests/executor/test_self_check.py": 12, "tests/executor/test_half_precision.py": 9,
    "tests/builders/test_shapes.py": 9, "tests/executor/test_step_cache.py": 8,
    "tests/builders/test_embedded.py": 8, "tests/executor/test_request_runner.py": 6,
    "tests/test_calibrate.py": 5, "tests/executor/test_z_image_chroma.py": 4,
    "tests/executor/test_quantization.py": 3, "tests/executor/test_stages.py": 3,
    **dict.fromkeys([
        "tests/executor/test_pause.py", "tests/executor/test_samplers.py", "tests/executor/test_wan.py"], 2),
    **dict.fromkeys([
        "tests/executor/test_blocks.py", "tests/executor/test_devices.py",
        "tests/executor/test_float32_place.py", "tests/executor/test_outputs.py",
        "tests/executor/test_tasks.py",
        "tests/executor/test_attention.py",
        "tests/executor/test_flux_kontext.py", "tests/executor/test_loops.py", "tests/executor/test_parallel.py",
        "tests/executor/test_planner.py", "tests/executor/test_step_timer.py",
        "tests/executor/test_weights.py", "tests/frontend/test_edit_rules.py",
        "tests/frontend/test_encode.py", "tests/frontend/test_scheduler_client.py",
        "tests/frontend/test_validation.py", "tests/frontend/test_openai_params.py",
        "tests/frontend/test_image_job_store.py", "tests/frontend/test_image_urls.py",
        "tests/policies/test_fair.py",
        "tests/policies/test_oldest.py", "tests/policies/test_priority.py",
        "tests/policies/test_sjf.py", "tests/policies/test_srpt.py",
        "tests/scheduler/test_adapter_slots.py", "tests/scheduler/test_batcher.py",
        "tests/scheduler/test_core.py", "tests/scheduler/test_preemption.py",
        "tests/scheduler/test_step_sets.py",
        "tests/scheduler/test_supervisor.py", "tests/scheduler/test_weights.py",
        "tests/test_compare_rounds.py", "tests/test_docs.py", "tests/test_imports.py",
        "tests/test_ports.py", "tests/test_protocol.py", "tests/test_server_metrics.py",
        "tests/test_workers.py", "tests/device/test_device_layer.py",
        "tests/device/test_one_layer.py", "tests/executor/test_sleep.py"], 1),
}
DEFAULT_S = 1.0


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def shares(nodeids: Sequence[str], count: int) -> list[list[int]]:
    """The indices of ``nodeids`` each of ``count`` workers runs from the start (the pool's
    files left out): each file goes whole to the least loaded worker, the heaviest first (ties
    by name), and each share keeps its order."""
    files = [f for f in dict.fromkeys(map(file_of, nodeids)) if f not in IN_PROCESS]
    load = [0.0] * count
    owner: dict[str, int] = {}
    for file in sorted(files, key=lambda f: (-SECONDS.get(f, DEFAULT_S), f)):
        worker = min(range(count), key=lambda w: (load[w], w))
        owner[file] = worker
        load[worker] += SECONDS.get(file, DEFAULT_S)
    found: list[list[int]] = [[] for _ in range(count)]
    for index, nodeid in enumerate(nodeids):
        if file_of(nodeid) in owner:
            found[owner[file_of(nodeid)]].append(index)
    return found


def pool(nodeids: Sequence[str]) -> list[list[int]]:
    """The pool: the indices of each :data:`IN_PROCESS` file's tests, the heaviest file first."""
    by_file: dict[str, list[int]] = {}
    for index, nodeid in enumerate(nodeids):
        if file_of(nodeid) in IN_PROCESS:
            by_file.setdefault(file_of(nodeid), []).append(index)
    return [by_file[f] for f in sorted(by_file, key=lambda f: (-IN_PROCESS[f], f))]


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
    return shares_scheduler()(config, log)


@functools.cache
def shares_scheduler() -> type:
    from xdist.scheduler import EachScheduling

    class Shares(EachScheduling):
        """Each worker gets its share (:func:`shares`) at the start, then the pool's files, one
        at a time, whenever it is down to its last test: a worker holds its last test back until
        it knows what follows it, so that is when it asks for more. Once the pool is empty every
        worker is told to finish. A worker that replaces a crashed one runs what that one had
        left."""

        def __init__(self, config, log=None) -> None:
            super().__init__(config, log)
            self.pool: list[list[int]] | None = None

        @property
        def tests_finished(self) -> bool:
            return not self.pool and super().tests_finished

        def schedule(self) -> None:
            assert self.collection_is_completed
            for node, pending in self.node2pending.items():
                if node in self._started:
                    continue
                collection = self.node2collection.get(node) or next(iter(self.node2collection.values()))
                if self.pool is None:
                    self.pool = pool(collection)
                if not pending:
                    pending[:] = shares(collection, self.numnodes)[worker_index(node.gateway.id)]
                if pending:
                    node.send_runtest_some(list(pending))
                self._started.append(node)
            for node in list(self._started):
                self.feed(node)

        def mark_test_complete(self, node, item_index: int, duration: float = 0) -> None:
            super().mark_test_complete(node, item_index, duration)
            self.feed(node)

        def feed(self, node) -> None:
            pending = self.node2pending.get(node)
            # Not to one told to finish already (here, or at -x or Ctrl-C): it would not run them.
            if pending is not None and len(pending) < 2 and self.pool and not node.shutting_down:
                more = self.pool.pop(0)
                pending += more
                node.send_runtest_some(more)
            if not self.pool:
                for other in self._started:
                    if other in self.node2pending and not other.shutting_down:
                        other.shutdown()

    return Shares
