"""The suite's split between xdist workers (tests/workers.py): whole files, balanced by their
recorded seconds, every test exactly once, each share in collection order; the pool's files
handed out whole to whichever worker runs out of work first."""

from __future__ import annotations

from types import SimpleNamespace

import workers


def test_shares_are_whole_files_balanced_and_in_order(monkeypatch):
    monkeypatch.setattr(workers, "SECONDS", {"a.py": 10, "b.py": 6, "c.py": 5})
    monkeypatch.setattr(workers, "IN_PROCESS", {})
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


class Worker:
    """Stands in for xdist's controller of one worker: what it was sent, in order. Like a real
    worker it runs a test only once it knows the next one, or once it is told to finish."""

    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.queue: list[int] = []
        self.ran: list[int] = []
        self.finishing = False

    def send_runtest_some(self, indices) -> None:
        self.queue += indices

    def shutdown(self) -> None:
        self.finishing = True

    @property
    def shutting_down(self) -> bool:
        return self.finishing

    def runnable(self) -> bool:
        return len(self.queue) >= 2 or (self.finishing and bool(self.queue))


def test_the_pool_goes_whole_files_at_a_time_to_whoever_runs_out_first(monkeypatch):
    monkeypatch.setattr(workers, "SECONDS", {"s1.py": 10, "s2.py": 10})
    monkeypatch.setattr(workers, "IN_PROCESS", {"big.py": 5, "mid.py": 3, "small.py": 1})
    nodeids = ["s1.py::a", "s1.py::b", "big.py::a", "big.py::b", "s2.py::a", "mid.py::a",
               "small.py::a", "small.py::b", "s1.py::c"]
    assert workers.shares(nodeids, 2) == [[0, 1, 8], [4]]
    assert workers.pool(nodeids) == [[2, 3], [5], [6, 7]]  # the heaviest first
    config = SimpleNamespace(getvalue=lambda name: ["2*popen"] if name == "tx" else None)
    sched = workers.shares_scheduler()(config)
    fast, slow = Worker("gw1"), Worker("gw0")  # gw1 has one test of its own, gw0 three
    for node in (slow, fast):
        sched.add_node(node)
        sched.add_node_collection(node, nodeids)
    sched.schedule()
    assert slow.queue == [0, 1, 8] and fast.queue == [4, 2, 3]  # down to its last test: fed
    for _ in range(len(nodeids)):  # bounded: a scheduler that stops feeding fails, not hangs
        if sched.tests_finished:
            break
        # Each round gw1 runs two tests and gw0 one: gw1 takes most of the pool.
        for node, runs in ((fast, 2), (slow, 1)):
            for _ in range(runs):
                if node.runnable():
                    node.ran.append(node.queue.pop(0))
                    sched.mark_test_complete(node, node.ran[-1])
    assert sched.tests_finished
    for node in (slow, fast):  # told to finish, they run what they hold
        assert node.finishing
        node.ran += node.queue
    assert sorted(slow.ran + fast.ran) == list(range(len(nodeids)))
    assert fast.ran == [4, 2, 3, 5, 6, 7] and slow.ran == [0, 1, 8]  # whole files, in pool order


def test_a_worker_told_to_finish_gets_no_more_of_the_pool(monkeypatch):
    """After -x stops the session at a failure, say: the pool stays where it is."""
    monkeypatch.setattr(workers, "SECONDS", {"s.py": 10})
    monkeypatch.setattr(workers, "IN_PROCESS", {"p.py": 5})
    nodeids = ["s.py::a", "s.py::b", "p.py::a"]
    config = SimpleNamespace(getvalue=lambda name: ["1*popen"] if name == "tx" else None)
    sched = workers.shares_scheduler()(config)
    node = Worker("gw0")
    sched.add_node(node)
    sched.add_node_collection(node, nodeids)
    sched.schedule()
    assert node.queue == [0, 1]
    node.shutdown()  # as the session does when it stops early
    sched.mark_test_complete(node, node.queue.pop(0))
    assert node.queue == [1] and sched.pool == [[2]]
