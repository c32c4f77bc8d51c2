"""The start-up checks: each task's plain pipeline and, in step mode, the step engine against it
(``startup``), the float32 reference a half-precision model is judged by (``float32``), the
verdicts remembered per model and code (``verdicts``), what they decide applied to what is
served (``apply``), and the plain pipeline called alone with a request's inputs, the oracle the
tests and benchmarks judge by too (``reference``). Runs the engines through a built runtime; may import every room below it."""
