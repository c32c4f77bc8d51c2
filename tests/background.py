"""Long runs that start as soon as the session's tests are known and finish while other tests run.

Some tests wait mostly on other processes: the Ray application's run (a cluster, replicas that
load models, jobs polled) or a ``compare.py`` run (servers started one after another, each
loading a model on one core). Run when their test comes, they hold the session up for a minute
with a core idle. Declared with :func:`early`, such a run starts in a background thread when
collection finishes (if a selected test names it with ``@pytest.mark.early(name)``), and the test
takes its result with :func:`result`, which waits for it (or runs it then, where it was not
started). A run's exception is raised in the test that takes it. At most ``AT_ONCE`` run at once,
the heaviest first.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

AT_ONCE = 2

_declared: dict[str, tuple[float, Callable[[], Any]]] = {}  # name -> (weight, run)
_runs: dict[str, Future] = {}
_pool = ThreadPoolExecutor(AT_ONCE, thread_name_prefix="early-run")


def early(name: str, weight: float = 1.0, run: Callable[[], Any] | None = None):
    """Declare ``run`` (or the decorated function) as the early run ``name``; ``weight`` orders
    the starts (heaviest first)."""
    def declare(fn: Callable[[], Any]) -> Callable[[], Any]:
        _declared[name] = (weight, fn)
        return fn
    return declare(run) if run is not None else declare


def start(items) -> None:
    """Start the runs the selected ``items`` name (pytest_collection_finish)."""
    wanted = {name for item in items for marker in item.iter_markers("early")
              for name in marker.args}
    for name in sorted(wanted & set(_declared), key=lambda n: -_declared[n][0]):
        if name not in _runs:
            _runs[name] = _pool.submit(_declared[name][1])


def result(name: str) -> Any:
    if name not in _runs:
        _runs[name] = _pool.submit(_declared[name][1])
    return _runs[name].result()


def close() -> None:
    """Wait for what still runs (a run is never abandoned halfway: its processes stop)."""
    _pool.shutdown(wait=True, cancel_futures=True)
