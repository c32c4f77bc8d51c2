"""The monitoring files shipped in deploy/ as the tests read them, the PromQL made of them, and
a real Prometheus to run it (``tests/test_prometheus.py``).

How dashboard queries become PromQL: Grafana's variables are substituted as a dashboard showing
this one server would: ``$job``, ``$instance`` and ``$executor`` by the values their own variable
queries (``label_values(...)``, run through Prometheus's label API) return; ``$__rate_interval``
by ``1m`` and ``$__range`` by ``5m`` (enough for the two or more 1 s scrapes ``rate()`` needs).
The datasource is ignored.

How alert expressions lose their threshold (:func:`data_parts`): an alert fires on the series its
expression returns, and ``X > 10`` returns nothing while all is well. So the expression is split
at its top-level ``and``/``or`` (outside any bracket or string) into operands, and each operand is
cut at its first top-level comparison operator (``==``, ``!=``, ``>=``, ``<=``, ``>``, ``<``),
keeping the left-hand side: ``A / B > 0.8 and B > 0`` is evaluated as ``A / B`` and as ``B``.
PromQL's comparisons bind more loosely than arithmetic, so the left-hand side is the measured
quantity itself.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import yaml

from diffserve.ports import free_port
from pace import scaled

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
CONFIG = PROMETHEUS_DIR / "prometheus.yml"
RULES = PROMETHEUS_DIR / "alerts.yml"
RULE_TESTS = PROMETHEUS_DIR / "alerts_test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "diffserve.json"
OPERATIONS = ROOT / "docs" / "operations.md"

GRAFANA_INTERVALS = {"$__rate_interval": "1m", "${__rate_interval}": "1m",
                     "$__range": "5m", "${__range}": "5m",
                     "$__interval": "15s", "${__interval}": "15s"}


# -- the shipped files, and PromQL ----------------------------------------------------------

def load_rules() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels(dashboard: dict) -> list[dict]:
    """Every panel, including those nested in collapsed rows."""
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expr) for every Prometheus query of the dashboard."""
    return [(panel["title"], target["expr"]) for panel in dashboard_panels(dashboard)
            for target in panel.get("targets", []) if target.get("expr")]


def _top_level(expr: str):
    """Yield (index, char) for the characters of ``expr`` outside brackets and strings."""
    depth, quote, i = 0, None, 0
    while i < len(expr):
        ch = expr[i]
        if quote:
            if ch == "\\":
                i += 2
                continue
            if ch == quote:
                quote = None
        elif ch in "\"'`":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0:
            yield i, ch
        i += 1


_IDENT = re.compile(r"[A-Za-z0-9_:]")


def _split_set_operators(expr: str) -> list[str]:
    """``expr`` split at its top-level ``and`` / ``or``."""
    parts, start = [], 0
    for i, _ in _top_level(expr):
        for word in ("and", "or", "unless"):
            end = i + len(word)
            if (expr[i:end] == word and (i == 0 or not _IDENT.match(expr[i - 1]))
                    and (end == len(expr) or not _IDENT.match(expr[end]))):
                assert word != "unless", f"no rule uses unless; teach data_parts about it: {expr}"
                if i >= start:
                    parts.append(expr[start:i])
                    start = end
    parts.append(expr[start:])
    return [p.strip() for p in parts]


def _strip_comparison(expr: str) -> str:
    """The left-hand side of ``expr``'s first top-level comparison (``expr`` if it has none)."""
    for i, ch in _top_level(expr):
        if expr[i:i + 2] in ("==", "!=", ">=", "<=") or ch in "<>":
            return expr[:i].strip()
    return expr.strip()


def data_parts(expr: str) -> list[str]:
    """The measured quantities of an alert expression, without their thresholds."""
    return [_strip_comparison(part) for part in _split_set_operators(expr)]


def slug(heading: str) -> str:
    """The anchor GitHub and most Markdown renderers give a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def substitute(expr: str, variables: dict[str, str]) -> str:
    for name, value in GRAFANA_INTERVALS.items():
        expr = expr.replace(name, value)
    for name, value in variables.items():
        expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
    assert "$" not in expr, f"an unknown Grafana variable is left in {expr!r}"
    return expr


# -- a real Prometheus ----------------------------------------------------------------------

def write_test_config(directory: Path, target: str) -> Path:
    """The shipped config, pointed at ``target`` and scraping/evaluating every second; the rule
    files are copied beside it so that its relative ``rule_files`` still resolve."""
    config = yaml.safe_load(CONFIG.read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    for job in config["scrape_configs"]:
        for key in ("scrape_interval", "scrape_timeout"):
            if key in job:
                job[key] = "1s"
        if job["job_name"] == "diffserve":
            job["static_configs"] = [{"targets": [target]}]
    for rule_file in config["rule_files"]:
        shutil.copy(PROMETHEUS_DIR / rule_file, directory / rule_file)
    path = directory / "prometheus.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


class Prometheus:
    def __init__(self, binary: str, config: Path, data: Path, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.cmd = [binary, f"--config.file={config}", f"--storage.tsdb.path={data}",
                    f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"]
        self.client = httpx.Client(base_url=self.url, timeout=10, trust_env=False)

    def __enter__(self) -> "Prometheus":
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_ready(timeout_s=scaled(60))
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited with {self.proc.returncode}:\n"
                                     f"{self.log.read_text(errors='replace')[-3000:]}")
            try:
                if self.client.get("/-/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"prometheus was not ready within {timeout_s:g} s"
            time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(scaled(15))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(scaled(10))

    def api(self, path: str, **params) -> dict:
        response = self.client.get("/api/v1/" + path, params=params)
        body = response.json()
        assert body["status"] == "success", f"{path} {params}: {body.get('error', body)}"
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        data = self.api("query", query=expr)
        return data["result"] if data["resultType"] in ("vector", "matrix") else [data["result"]]
