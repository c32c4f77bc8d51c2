"""Start an HTTP server (``diffserve serve``, or any command) as a subprocess and wait until it
is ready; the one launcher the tests and the benchmarks share.

Ready means ``GET /health`` answers 200, the probe a load balancer or Kubernetes would use. The
server's output goes to a log file, whose end is quoted when it fails to start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from diffserve.ports import free_port


def diffserve_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "diffserve", "serve", *args]


class LaunchError(RuntimeError):
    pass


class ServerProcess:
    """``with ServerProcess(cmd, port, log) as server:`` starts, waits for health, always stops."""

    def __init__(self, cmd: list[str], port: int, log_path: str | Path,
                 env: dict[str, str] | None = None, startup_timeout_s: float = 300.0,
                 name: str = "server", stop_timeout_s: float = 30.0) -> None:
        """``stop_timeout_s``: how long :meth:`stop` gives it after the signal by default."""
        self.cmd, self.port, self.log_path = cmd, port, Path(log_path)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.name = name
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    @classmethod
    def diffserve(cls, *args: str, log_path: str | Path, port: int | None = None,
                  **kwargs) -> "ServerProcess":
        port = port or free_port()
        return cls(diffserve_command("--port", str(port), *args), port, log_path, **kwargs)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def launch(self) -> "ServerProcess":
        """Start the process without waiting for it (see :meth:`wait_ready`)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._launched_at = time.monotonic()
        with open(self.log_path, "wb") as log:
            # Its own session: a Ctrl-C in a terminal reaches us, and we stop it in order.
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env,
                                         start_new_session=True)
        return self

    def wait_ready(self) -> "ServerProcess":
        """Poll ``/health`` until 200; on failure stop the server and raise LaunchError."""
        deadline = self._launched_at + self.startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise LaunchError(f"{self.name} exited with code {self.proc.returncode} before it "
                                  f"was ready:\n{self._tail()}")
            if self.healthy():
                self.startup_s = time.monotonic() - self._launched_at
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise LaunchError(f"{self.name} was not ready within {self.startup_timeout_s:g} s:"
                                  f"\n{self._tail()}")
            time.sleep(0.05)  # the server pushes no readiness event; /health is the probe

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, OSError):
            return False  # not listening yet, or 503 while no executor is ready

    def start(self) -> "ServerProcess":
        return self.launch().wait_ready()

    def send_signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGINT, timeout_s: float | None = None) -> int | None:
        """A clean shutdown (SIGINT), then SIGKILL if it lingers past ``timeout_s`` (default
        ``stop_timeout_s``), raising TimeoutExpired. Returns the exit code."""
        if self.proc is None:
            return None
        self.send_signal(sig)
        try:
            return self.proc.wait(self.stop_timeout_s if timeout_s is None else timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise

    def _tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.splitlines()[-lines:])

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
