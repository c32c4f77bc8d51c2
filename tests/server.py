"""Start ``diffserve serve`` exactly as a user does, as a subprocess, for end-to-end tests."""

from __future__ import annotations

import base64
import io
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

READY_LINE = "diffserve ready: serving"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def process_title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


class Server:
    """``model``: the fast random-weight fixture by default; None serves the product's default
    model, exactly as a user who passes no --model."""

    def __init__(self, *args: str, model: str | None = "tiny-sd",
                 env: dict[str, str] | None = None, timeout_s: float = 120):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if model is not None and "--model" not in args:
            args = ("--model", model, *args)
        self.args = ["--port", str(self.port), *args]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.timeout_s = timeout_s
        self.lines: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()

    def start(self) -> "Server":
        self.proc = subprocess.Popen([sys.executable, "-m", "diffserve", "serve", *self.args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=self.env)
        threading.Thread(target=self._pump, daemon=True).start()
        return self

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            self._lines.put(line)
        self._lines.put(None)

    def wait_for_line(self, text: str, timeout_s: float | None = None) -> bool:
        """Block until the server prints ``text`` (True) or exits (False)."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"server did not print {text!r}:\n{self.log}") from None
            if line is None:
                return False
            if text in line:
                return True

    def wait_ready(self) -> "Server":
        if not self.wait_for_line(READY_LINE):
            raise RuntimeError(f"server exited with {self.proc.wait()}:\n{self.log}")
        return self

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kwargs.pop("timeout", 120), **kwargs)

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def __enter__(self) -> "Server":
        return self.start().wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()


def decode(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def metric(text: str, name: str) -> float:
    """A sample's value from Prometheus text (0 if absent); ``name`` may include labels."""
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def wait_for_metric(server: "Server", name: str, predicate, timeout_s: float = 60) -> float:
    """Poll /metrics until ``predicate(value)``: the server exposes no push event for this."""
    deadline = time.monotonic() + timeout_s
    with server.client() as c:
        while True:
            value = metric(c.get("/metrics").text, name)
            if predicate(value):
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} stayed at {value}")
            time.sleep(0.02)


def assert_openai_error(response, status: int, param=None, code=None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
    if code is not None:
        assert body["error"]["code"] == code
    return body["error"]


def pids_titled(root: int, title: str) -> list[int]:
    return [p for p in descendants(root) if process_title(p).startswith(title)]
