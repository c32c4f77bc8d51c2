"""The monitoring files shipped in deploy/: the Prometheus scrape config, the alert rules and the
Grafana dashboard.

- Static checks (always run): the dashboard is importable and every panel says what it shows;
  every alert rule has a ``for``, a severity, a summary, a description and a runbook link that
  names a section of docs/operations.md.
- ``promtool`` (skipped without it): ``check config``, ``check rules`` and the rule unit tests
  (``deploy/prometheus/alerts_test.yml``).
- Live (skipped without ``prometheus``): a diffserve server started as a user would, under load,
  scraped by a real Prometheus running the shipped config (only the target and the intervals
  changed). Every dashboard query and every alert expression must evaluate without error through
  ``/api/v1/query`` and return data.

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
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from diffserve.launcher import ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
CONFIG = PROMETHEUS_DIR / "prometheus.yml"
RULES = PROMETHEUS_DIR / "alerts.yml"
RULE_TESTS = PROMETHEUS_DIR / "alerts_test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "diffserve.json"
OPERATIONS = ROOT / "docs" / "operations.md"

INSTALL_HINT = ("not installed: install Prometheus to run this test (Debian/Ubuntu: "
                "`apt-get install prometheus`, which provides both `prometheus` and `promtool`; "
                "elsewhere put the binaries from https://prometheus.io/download/ on PATH)")

GRAFANA_INTERVALS = {"$__rate_interval": "1m", "${__rate_interval}": "1m",
                     "$__range": "5m", "${__range}": "5m",
                     "$__interval": "15s", "${__interval}": "15s"}

pytestmark = pytest.mark.timeout(300)


# -- helpers --------------------------------------------------------------------------------

def need(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        pytest.skip(f"{binary} {INSTALL_HINT}")
    return path


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


# -- static checks --------------------------------------------------------------------------

def test_data_parts_strips_thresholds_only_at_the_top_level():
    assert data_parts('up{job="diffserve"} == 0') == ['up{job="diffserve"}']
    assert data_parts('sum by (le) (rate(x_bucket{a!="b"}[5m])) >= 1') == [
        'sum by (le) (rate(x_bucket{a!="b"}[5m]))']
    assert data_parts("a / max by (i) (b) > 0.8 and max by (i) (b) > 0") == [
        "a / max by (i) (b)", "max by (i) (b)"]
    assert data_parts('sum(rate(random_name{status=~"a|b"}[1m]))') == [
        'sum(rate(random_name{status=~"a|b"}[1m]))']
    assert data_parts("min(x_and_y) == 0 or max(brand) > 1") == ["min(x_and_y)", "max(brand)"]


def test_the_dashboard_is_importable_and_every_panel_is_described():
    dashboard = load_dashboard()
    assert dashboard["schemaVersion"] >= 36 and dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["type"] == "query"
    panels = [p for p in dashboard_panels(dashboard) if p["type"] != "row"]
    assert len({p["id"] for p in dashboard_panels(dashboard)}) == len(dashboard_panels(dashboard))
    for panel in panels:
        assert panel.get("description", "").strip(), f"panel {panel['title']!r} has no description"
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
    for title, expr in dashboard_queries(dashboard):
        # Rate windows follow the scrape interval Grafana knows, not a fixed guess.
        for window in re.findall(r"\[([^\]]*)\]", expr):
            assert window in ("$__rate_interval", "$__range"), (title, expr)
        if "diffserve_" in expr or "up{" in expr:
            assert 'instance=~"$instance"' in expr, (title, expr)
    titles = " | ".join(p["title"] for p in panels).lower()
    for needed in ("throughput by status", "latency", "queue time", "waiting and running",
                   "batch size", "busy share", "images per second", "restarts", "step time",
                   "running-set size", "dispatch reasons", "executor ready"):
        assert needed in titles, needed


def test_every_alert_has_a_for_a_severity_and_a_runbook_section():
    anchors = {slug(line.lstrip("#")) for line in OPERATIONS.read_text().splitlines()
               if line.startswith("#")}
    rules = load_rules()
    assert {r["alert"] for r in rules} >= {"DiffserveDown", "DiffserveNotReady",
                                           "DiffserveExecutorRestarted", "DiffserveRequestsFailing",
                                           "DiffserveQueueTimeHigh", "DiffserveQueueNearlyFull"}
    for rule in rules:
        name = rule["alert"]
        assert "for" in rule, name
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
        page, _, anchor = rule["annotations"]["runbook_url"].partition("#")
        assert page == "docs/operations.md", name
        assert anchor in anchors, f"{name}: docs/operations.md has no section #{anchor}"


def test_the_scrape_config_names_the_default_server_and_the_rules():
    config = yaml.safe_load(CONFIG.read_text())
    assert config["rule_files"] == ["alerts.yml"]
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "diffserve"]
    assert job["static_configs"][0]["targets"] == ["127.0.0.1:8000"]


# -- promtool -------------------------------------------------------------------------------

def test_promtool_accepts_the_config_and_the_rules_and_their_unit_tests():
    promtool = need("promtool")
    for args in (["check", "config", str(CONFIG)], ["check", "rules", str(RULES)],
                 ["test", "rules", str(RULE_TESTS)]):
        result = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60,
                                cwd=ROOT)
        assert result.returncode == 0, f"promtool {' '.join(args)}:\n{result.stdout}{result.stderr}"


# -- live -----------------------------------------------------------------------------------

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
            self._wait_ready(timeout_s=60)
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
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def api(self, path: str, **params) -> dict:
        response = self.client.get("/api/v1/" + path, params=params)
        body = response.json()
        assert body["status"] == "success", f"{path} {params}: {body.get('error', body)}"
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        data = self.api("query", query=expr)
        return data["result"] if data["resultType"] in ("vector", "matrix") else [data["result"]]


def put_under_load(url: str, seconds: float, clients: int = 4, max_requests: int = 600) -> dict:
    """Concurrent generation requests for ``seconds`` (at most ``max_requests``), with one bad
    request in ten; returns the count of each HTTP status."""
    statuses: dict[int, int] = {}
    lock = threading.Lock()
    sent = iter(range(max_requests))
    deadline = time.monotonic() + seconds

    def client(index: int) -> None:
        with httpx.Client(base_url=url, timeout=60, trust_env=False) as http:
            for i in sent:
                if time.monotonic() > deadline:
                    return
                if i % 10 == 9:
                    body = {"prompt": ""}  # 400: too short
                else:
                    body = {"prompt": f"load {index}", "seed": i, "num_inference_steps": 2,
                            "n": 1 + i % 3}
                try:
                    status = http.post("/v1/images/generations", json=body).status_code
                except httpx.TransportError:
                    status = -1
                with lock:
                    statuses[status] = statuses.get(status, 0) + 1

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 120)
    return statuses


def label_values(prom: Prometheus, definition: str, variables: dict[str, str]) -> list[str]:
    """Run a Grafana ``label_values(selector, label)`` variable query through the label API."""
    match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", definition.strip())
    assert match, f"unsupported variable query {definition!r}"
    selector, label = substitute(match.group(1), variables), match.group(2)
    return prom.api(f"label/{label}/values", **{"match[]": selector})


def test_every_dashboard_query_and_alert_expression_returns_data(tmp_path):
    prometheus = need("prometheus")
    started = time.monotonic()
    with ServerProcess.diffserve("--model", "tiny-sd", "--max-queue-size", "64",
                                 "--torch-threads", "1",
                                 log_path=tmp_path / "server.log") as server:
        target = f"127.0.0.1:{server.port}"
        config = write_test_config(tmp_path, target)
        with Prometheus(prometheus, config, tmp_path / "tsdb", tmp_path / "prometheus.log") as prom:
            statuses = put_under_load(server.url, seconds=10)
            assert statuses.get(200, 0) >= 20 and statuses.get(400, 0) >= 2, statuses
            assert set(statuses) <= {200, 400}, statuses

            # Wait until Prometheus holds the load: several scrapes, the last one after it.
            deadline = time.monotonic() + 30
            while True:
                scrapes = prom.query('count_over_time(up{job="diffserve"}[1m])')
                done = prom.query('sum(diffserve_requests_total{job="diffserve"})')
                if (scrapes and float(scrapes[0]["value"][1]) >= 3 and done
                        and float(done[0]["value"][1]) >= sum(statuses.values())):
                    break
                assert time.monotonic() < deadline, (scrapes, done, statuses)
                time.sleep(0.5)

            (scraped,) = prom.api("targets", state="active")["activeTargets"]
            assert scraped["health"] == "up" and scraped["labels"]["instance"] == target, scraped

            # The dashboard's variables, resolved by their own queries in order.
            dashboard = load_dashboard()
            variables: dict[str, str] = {}
            for var in dashboard["templating"]["list"]:
                if var["type"] != "query":
                    continue
                values = label_values(prom, var["definition"], variables)
                assert values, f"variable {var['name']}: {var['definition']} found nothing"
                variables[var["name"]] = values[0]
            assert variables["instance"] == target and variables["job"] == "diffserve", variables

            checks = [(f"panel {title!r}", substitute(expr, variables))
                      for title, expr in dashboard_queries(dashboard)]
            checks += [(f"alert {rule['alert']}", part) for rule in load_rules()
                       for part in data_parts(rule["expr"])]
            failures: dict[str, str] = {}
            deadline = time.monotonic() + 20
            pending = checks
            while pending:
                failures = {}
                for name, expr in pending:
                    response = prom.client.get("/api/v1/query", params={"query": expr}).json()
                    if response["status"] != "success":
                        failures[f"{name}: {expr}"] = response.get("error", str(response))
                    elif not response["data"]["result"]:
                        failures[f"{name}: {expr}"] = "no data"
                errors = {k: v for k, v in failures.items() if v != "no data"}
                assert not errors, "queries Prometheus refused:\n" + "\n".join(
                    f"{k}\n  -> {v}" for k, v in errors.items())
                pending = [(n, e) for n, e in pending if f"{n}: {e}" in failures]
                if not pending or time.monotonic() > deadline:
                    break
                time.sleep(1)
            assert not failures, "queries without data:\n" + "\n".join(failures)

            # What the load did shows through the dashboard's own throughput query.
            by_status = {r["metric"]["status"]: float(r["value"][1]) for r in prom.query(
                substitute(dict(dashboard_queries(dashboard))["Request throughput by status"],
                           variables))}
            assert by_status["success"] > 0 and by_status["invalid"] > 0, by_status
            mode = prom.query('diffserve_batching_mode{job="diffserve"} == 1')
            assert [r["metric"]["mode"] for r in mode] == ["step"], mode

            # Prometheus loaded the shipped rules and evaluates every one without error.
            loaded = [rule for group in prom.api("rules")["groups"] for rule in group["rules"]]
            assert sorted(r["name"] for r in loaded) == sorted(r["alert"] for r in load_rules())
            for rule in loaded:
                assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))
    assert time.monotonic() - started < 120
