"""Start ``diffserve serve`` exactly as a user does, as a subprocess, for end-to-end tests."""

from __future__ import annotations

import base64
import contextlib
import inspect
import io
import json
import os
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, NamedTuple

import httpx
import numpy as np
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from diffserve.serving.launcher import ServerProcess, diffserve_command
from diffserve.ports import free_port
from pace import scaled
from workers import this_worker

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
            if int(fields[3]) == sid and fields[0] != "Z":  # state, ppid, pgrp, session
                found.append(int(entry.name))
    return found


def process_title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


class Server(ServerProcess):
    """``diffserve serve`` exactly as a user starts it. ``model``: the fast random-weight fixture
    by default; None serves the product's default model, as a user who passes no --model.

    Its environment has ``OMP_NUM_THREADS=1`` unless ``env`` says otherwise: torch's default
    (``--torch-threads 0``) is then one intra-op thread, as on a one-core machine. Several
    servers and the tests share a few cores; a thread per core each would oversubscribe them, and
    OpenMP threads that wait for each other slow a busy machine down many times over."""

    def __init__(self, *args: str, model: str | None = "tiny-sd",
                 env: dict[str, str] | None = None, timeout_s: float = 120):
        if model is not None and "--model" not in args:
            args = ("--model", model, *args)
        port = free_port()
        log = Path(tempfile.mkdtemp(prefix="diffserve-test-")) / "server.log"
        super().__init__(diffserve_command("--port", str(port), *args), port, log,
                         env={"OMP_NUM_THREADS": "1", **(env or {})},
                         startup_timeout_s=scaled(timeout_s), stop_timeout_s=scaled(30))

    stop_later = False  # see __exit__

    def start(self) -> "Server":
        """Launch (unless launched already, see :class:`Launches`) and wait until ready."""
        if self.proc is None:
            self.launch()
        return self.wait_ready()

    def __exit__(self, *exc) -> None:
        """The end of ``with``: a clean shutdown (SIGINT). A server handed out by
        :class:`Launches` or :class:`Queue` (``stop_later``) is left to exit while the next tests
        run; :data:`STOPPING` still holds it to the same bound (see :class:`Stopping`)."""
        if self.stop_later:
            STOPPING.stop(self)
        else:
            self.stop()

    def wait_for_line(self, text: str, timeout_s: float = 60) -> bool:
        """Wait until the server logs ``text`` (True) or exits without it (False). The log is a
        file: it is read again every 20 ms, the server having no other way to say it."""
        deadline = time.monotonic() + scaled(timeout_s)
        while True:
            if text in self.log:
                return True
            if self.proc.poll() is not None:
                return text in self.log
            if time.monotonic() > deadline:
                raise TimeoutError(f"server did not log {text!r}:\n{self.log}")
            time.sleep(0.02)

    def client(self, **kwargs) -> httpx.Client:
        timeout = kwargs.pop("timeout", 120)  # a number is a bound; an httpx.Timeout, as given
        return httpx.Client(base_url=self.url, verify=TLS, **kwargs,
                            timeout=scaled(timeout) if isinstance(timeout, (int, float)) else timeout)


# One TLS context for every test client. httpx builds a new one per client by default, loading
# the CA bundle each time (tens of ms of CPU: half a minute over a session that makes a client
# per request); the servers here speak plain HTTP anyway.
TLS = ssl.create_default_context()


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
    deadline = time.monotonic() + scaled(timeout_s)
    with server.client() as c:
        while True:
            value = metric(c.get("/metrics").text, name, **labels)
            if predicate(value):
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} stayed at {value}")
            time.sleep(0.02)


@contextlib.contextmanager
def hanging_up(server: "Server", body: dict, path: str = "/v1/images/generations"):
    """A caller that POSTs ``body`` and hangs up (closes its connection) when the block ends:
    what a client that gives up does, at a moment the test chooses."""
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as conn:
        conn.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        yield


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


# -- servers launched ahead of the tests that use them --------------------------------------------


class Stopping:
    """Servers asked to stop (SIGINT) that the tests no longer wait for: each must exit within
    ``timeout_s`` as ``ServerProcess.stop`` requires, else it is killed and named as a failure
    of the session (:meth:`check`, at its end). A server's shutdown (mostly its executor's
    interpreter exiting) then overlaps the next tests instead of holding them up."""

    def __init__(self, timeout_s: float = 30) -> None:
        self.timeout_s = scaled(timeout_s)
        self.threads: list[threading.Thread] = []
        self.failures: list[str] = []

    def stop(self, server: Server) -> None:
        if server.proc is None or getattr(server, "stopping", False):
            return
        server.stopping = True
        server.send_signal(signal.SIGINT)
        thread = threading.Thread(target=self._wait, args=(server,), daemon=True)
        thread.start()
        self.threads.append(thread)

    def _wait(self, server: Server) -> None:
        try:
            server.proc.wait(self.timeout_s)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(10)
            self.failures.append(f"{' '.join(server.cmd[2:])} did not exit within "
                                 f"{self.timeout_s:g} s of SIGINT (killed); log {server.log_path}")

    def check(self) -> list[str]:
        """Wait for every server asked to stop; what failed to."""
        for thread in self.threads:
            thread.join()
        self.threads.clear()
        return self.failures


STOPPING = Stopping()


class Spec(NamedTuple):
    """What ``Server(*args, model=..., env=..., timeout_s=...)`` is given."""
    args: tuple[str, ...] = ()
    model: str | None = "tiny-sd"
    env: tuple[tuple[str, str], ...] | None = None
    timeout_s: float = 120

    def server(self) -> Server:
        server = Server(*self.args, model=self.model, env=dict(self.env) if self.env else None,
                        timeout_s=self.timeout_s)
        server.stop_later = True
        return server


def spec(*args: str, model: str | None = "tiny-sd", env: dict[str, str] | None = None,
         timeout_s: float = 120) -> Spec:
    return Spec(tuple(args), model, tuple(sorted(env.items())) if env else None, timeout_s)


def serves(how: Spec | Callable[[object], Spec]):
    """Declares the server a module-scoped fixture yields: a :class:`Spec`, or a function of the
    fixture's param giving one. The fixture gets it with ``Launches.take(request)``, launched
    ahead like a test's own server (``@pytest.mark.server``)."""
    def declare(fixture):
        SERVED[(fixture.__module__, fixture.__name__)] = how
        return fixture
    return declare


SERVED: dict[tuple[str, str], Spec | Callable[[object], Spec]] = {}


def _marker_spec(marker, params: dict) -> Spec:
    """``@pytest.mark.server(*args, **kwargs)``: Server's arguments, each string formatted with
    the test's params (``"--batching-mode", "{mode}"``); or one function of some params giving a
    :class:`Spec` (named by its parameters)."""
    if len(marker.args) == 1 and callable(marker.args[0]):
        fn = marker.args[0]
        return fn(**{name: params[name] for name in inspect.signature(fn).parameters})
    return spec(*(a.format(**params) for a in marker.args), **marker.kwargs)


class Launches:
    """``diffserve serve`` processes launched before the tests that need them run.

    A test that declares its own server (``@pytest.mark.server(...)``, taken with the
    ``own_server`` fixture) or uses a module's server fixture declared with :func:`serves` gets a
    server started exactly as ``Server(...)`` starts one, but launched while the tests before it
    ran: most of a start is one process importing torch and diffusers, which leaves the other
    cores to the tests. The plan is the session's tests in their order; at most ``ahead`` servers
    are launched and not yet taken (``DIFFSERVE_TEST_LAUNCH_AHEAD``; 0 launches each when it is
    needed). A server is handed over launched, not necessarily ready: ``start()`` (or ``with``)
    waits for it. Any launched but never taken is stopped at the end of the session."""

    def __init__(self, ahead: int) -> None:
        self.ahead = ahead
        self.plan: list[tuple] = []  # keys, in the order of the first test that needs each
        self.specs: dict[tuple, Spec] = {}
        self.span: dict[tuple, tuple[int, int]] = {}  # key -> (first, last) test needing it
        self.index: dict[str, int] = {}
        self.launched: dict[tuple, Server] = {}
        self.done: set[tuple] = set()
        self.next = 0

    def make_plan(self, items) -> None:
        self.plan.clear()
        self.specs.clear()
        self.span.clear()
        self.index.clear()
        self.next = 0
        for i, item in enumerate(items):
            self.index[item.nodeid] = i
            params = getattr(getattr(item, "callspec", None), "params", {})
            module = getattr(getattr(item, "module", None), "__name__", None)
            needs = []
            for name in getattr(item, "fixturenames", ()):
                how = SERVED.get((module, name))
                if how is not None:
                    param = params.get(name)
                    needs.append((("fixture", module, name, repr(param)),
                                  how(param) if callable(how) else how))
            marker = item.get_closest_marker("server")
            if marker is not None:
                needs.append((("own", item.nodeid), _marker_spec(marker, params)))
            for key, need in needs:
                if key not in self.specs:
                    self.specs[key] = need
                    self.plan.append(key)
                self.span[key] = (self.span.get(key, (i, i))[0], i)

    def top_up(self, nodeid: str) -> None:
        """Called as each test starts: stop what no test from here on needs, and launch the next
        servers the plan needs from this test on."""
        current = self.index.get(nodeid, 0)
        for key in [k for k in self.launched if self.span[k][1] < current]:
            self.done.add(key)  # its tests were skipped or deselected on the way
            STOPPING.stop(self.launched.pop(key))
        while self.next < len(self.plan) and len(self.launched) < self.ahead:
            key = self.plan[self.next]
            self.next += 1
            if key not in self.done and key not in self.launched and self.span[key][1] >= current:
                self.launched[key] = self.specs[key].server().launch()

    def take_key(self, key: tuple, fallback: Spec | None = None) -> Server:
        self.done.add(key)
        if key in self.launched:
            return self.launched.pop(key)
        need = self.specs.get(key, fallback)
        assert need is not None, f"no server declared for {key}"
        return need.server().launch()

    def take(self, request) -> Server:
        """The launched server of a fixture declared with :func:`serves`."""
        module, name = request.module.__name__, request.fixturename
        param = getattr(request, "param", None)
        how = SERVED[(module, name)]
        return self.take_key(("fixture", module, name, repr(param)),
                             how(param) if callable(how) else how)

    def take_own(self, item) -> Server:
        marker = item.get_closest_marker("server")
        assert marker is not None, "own_server needs @pytest.mark.server(...) on the test"
        params = getattr(getattr(item, "callspec", None), "params", {})
        return self.take_key(("own", item.nodeid), _marker_spec(marker, params))

    def close(self) -> None:
        for server in self.launched.values():
            STOPPING.stop(server)
        self.launched.clear()


class Queue:
    """Servers whose arguments are known only once a fixture has run (files they serve), launched
    in the order the tests take them: at most ``ahead`` launched and not yet taken. Whatever is
    left is stopped by :meth:`close`."""

    def __init__(self, specs: dict[str, Spec], ahead: int | None = None) -> None:
        self.specs = dict(specs)
        self.order = list(specs)
        self.ahead = LAUNCHES.ahead if ahead is None else ahead
        self.launched: dict[str, Server] = {}
        self._top_up()

    def _top_up(self) -> None:
        while self.order and len(self.launched) < self.ahead:
            name = self.order.pop(0)
            self.launched[name] = self.specs[name].server().launch()

    def take(self, name: str) -> Server:
        if name in self.launched:
            server = self.launched.pop(name)
        else:  # taken out of turn, or a second time
            if name in self.order:
                self.order.remove(name)
            server = self.specs[name].server().launch()
        self._top_up()
        return server

    def close(self) -> None:
        self.order.clear()
        for server in self.launched.values():
            STOPPING.stop(server)
        self.launched.clear()


# Two ahead in a process that runs every test; one in each of two xdist workers (tests/workers.py).
LAUNCHES = Launches(int(os.environ.get("DIFFSERVE_TEST_LAUNCH_AHEAD",
                                       "2" if this_worker() is None else "1")))
