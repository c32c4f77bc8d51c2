"""The suite's split between xdist workers (tests/workers.py): whole files, balanced by their
recorded seconds, every test exactly once, each share in collection order."""

from __future__ import annotations

import workers


def test_shares_are_whole_files_balanced_and_in_order(monkeypatch):
    monkeypatch.setattr(workers, "SECONDS", {"a.py": 10, "b.py": 6, "c.py": 5})
    nodeids = ["c.py::t1", "a.py::t1", "b.py::t1", "a.py::t2", "d.py::t1", "c.py::t2"]
    found = workers.shares(nodeids, 2)
    assert sorted(i for share in found for i in share) == list(range(len(nodeids)))
    assert found == [[1, 3, 4], [0, 2, 5]]  # a (10) + d (1 by default) | b (6) + c (5)
    assert all(share == sorted(share) for share in found)
    assert workers.shares(nodeids, 1) == [list(range(len(nodeids)))]
    assert workers.shares(nodeids, 2) == found  # every worker computes the same split


def test_a_process_outside_xdist_runs_everything(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert workers.this_worker() is None and workers.mine([1, 2, 3]) == [1, 2, 3]
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    assert workers.this_worker() == (1, 2)
