"""Starting and stopping HTTP servers for the benchmarks (used by compare.py).

A server is a subprocess with its output in a log file. It counts as up once ``GET /health``
answers 200 (the only readiness signal diffserve and the baseline give); if it exits first, or
the deadline passes, the error quotes the end of its log.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it; a race is possible but rare)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def diffserve_command(model: str, port: int, max_batch_size: int, delay_ms: float,
                      extra: list[str] | None = None) -> list[str]:
    return [sys.executable, "-m", "diffserve", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--model", model, "--dynamic-batch-max-size", str(max_batch_size),
            "--dynamic-batch-delay-ms", str(delay_ms), "--log-level", "warning", *(extra or [])]


def naive_command(model: str, port: int, threads: int | None = None,
                  copy_tokenizers: bool = False) -> list[str]:
    cmd = [sys.executable, str(HERE / "naive_server.py"), "--host", "127.0.0.1", "--port",
           str(port), "--model", model]
    if threads:
        cmd += ["--threads", str(threads)]
    if copy_tokenizers:
        cmd.append("--copy-tokenizers")
    return cmd


class ServerError(RuntimeError):
    pass


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class Server:
    """``with Server(cmd, log_path) as server:`` starts, waits for health, and always stops."""

    def __init__(self, cmd: list[str], log_path: Path, port: int, startup_timeout_s: float = 300.0,
                 env: dict[str, str] | None = None, name: str = "server") -> None:
        self.cmd, self.log_path, self.port = cmd, Path(log_path), port
        self.startup_timeout_s = startup_timeout_s
        self.env = env
        self.name = name
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self._launched_at = 0.0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def launch(self) -> "Server":
        """Start the process without waiting for it (see :meth:`wait_ready`)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        self._launched_at = time.monotonic()
        try:
            # Own session: a Ctrl-C in the terminal reaches us, and we stop the server in order.
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env,
                                         start_new_session=True)
        finally:
            log.close()
        return self

    def wait_ready(self) -> "Server":
        """Wait for ``/health``; on failure the server is stopped and ServerError raised."""
        try:
            wait_healthy(self.base_url, self.startup_timeout_s, self.proc, self.log_path, self.name)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - self._launched_at
        return self

    def start(self) -> "Server":
        return self.launch().wait_ready()

    def interrupt(self) -> None:
        """Ask for a clean shutdown (SIGINT) without waiting."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGINT (a clean shutdown), then SIGKILL if it lingers. Returns the exit code."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        return proc.returncode

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def wait_healthy(base_url: str, timeout_s: float, proc: subprocess.Popen | None = None,
                 log_path: Path | None = None, name: str = "server") -> None:
    """Poll ``GET /health`` until it answers 200; raise ServerError on exit or deadline."""
    deadline = time.monotonic() + timeout_s
    url = base_url.rstrip("/") + "/health"
    while True:
        if proc is not None and proc.poll() is not None:
            raise ServerError(f"{name} exited with code {proc.returncode} before it was healthy; "
                              f"last lines of {log_path}:\n{_tail(log_path) if log_path else ''}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass  # not listening yet, or 503 while the model loads
        if time.monotonic() > deadline:
            raise ServerError(f"{name} was not healthy within {timeout_s:g} s; last lines of "
                              f"{log_path}:\n{_tail(log_path) if log_path else ''}")
        time.sleep(0.2)


def child_env(**updates: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(updates)
    return env
