"""``diffserve serve`` as processes: the frontend process's entry (``server``), what it hosts (the
scheduler process and its executors, with the client that talks to them: ``backend``, which a Ray
Serve replica hosts too), and the launcher that starts a server and waits until it answers
(``launcher``, shared by the tests and the benchmarks)."""
