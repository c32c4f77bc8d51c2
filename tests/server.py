"""Start ``diffserve serve`` exactly as a user does, as a subprocess, for end-to-end tests."""

from __future__ import annotations

import base64
import io
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from diffserve.launcher import ServerProcess, diffserve_command, free_port

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


def session_members(sid: int) -> list[int]:
    """Every live (not zombie) process of session ``sid``: what a server left behind."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[4]) == sid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def process_title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


class Server(ServerProcess):
    """``diffserve serve`` exactly as a user starts it. ``model``: the fast random-weight fixture
    by default; None serves the product's default model, as a user who passes no --model."""

    def __init__(self, *args: str, model: str | None = "tiny-sd",
                 env: dict[str, str] | None = None, timeout_s: float = 120):
        if model is not None and "--model" not in args:
            args = ("--model", model, *args)
        port = free_port()
        log = Path(tempfile.mkdtemp(prefix="diffserve-test-")) / "server.log"
        super().__init__(diffserve_command("--port", str(port), *args), port, log, env=env,
                         startup_timeout_s=timeout_s)

    def wait_for_line(self, text: str, timeout_s: float = 60) -> bool:
        """Wait until the server logs ``text`` (True) or exits without it (False). The log is a
        file: it is read again every 20 ms, the server having no other way to say it."""
        deadline = time.monotonic() + timeout_s
        while True:
            if text in self.log:
                return True
            if self.proc.poll() is not None:
                return text in self.log
            if time.monotonic() > deadline:
                raise TimeoutError(f"server did not log {text!r}:\n{self.log}")
            time.sleep(0.02)

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kwargs.pop("timeout", 120), **kwargs)


def decode(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples called ``name`` whose labels include ``labels`` (0 if none)."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                total += sample.value
    return total


def wait_for_metric(server: "Server", name: str, predicate, timeout_s: float = 60,
                    **labels: str) -> float:
    """Poll /metrics until ``predicate(value)``: the server exposes no push event for this."""
    deadline = time.monotonic() + timeout_s
    with server.client() as c:
        while True:
            value = metric(c.get("/metrics").text, name, **labels)
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
