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

The PromQL made of the shipped files, and the Prometheus runner: ``tests/monitoring.py``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time

import httpx
import pytest
import yaml

from monitoring import (
    CONFIG,
    OPERATIONS,
    ROOT,
    RULE_TESTS,
    RULES,
    Prometheus,
    dashboard_panels,
    dashboard_queries,
    data_parts,
    load_dashboard,
    load_rules,
    slug,
    substitute,
    write_test_config,
)
from pace import scaled

INSTALL_HINT = ("not installed: install Prometheus to run this test (Debian/Ubuntu: "
                "`apt-get install prometheus`, which provides both `prometheus` and `promtool`; "
                "elsewhere put the binaries from https://prometheus.io/download/ on PATH)")

pytestmark = pytest.mark.timeout(300)


# -- helpers --------------------------------------------------------------------------------

def need(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        pytest.skip(f"{binary} {INSTALL_HINT}")
    return path


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


@pytest.mark.server("--model", "tiny-sd", "--max-queue-size", "64", "--torch-threads", "1",
                    "--device-peak-tflops", "0.05")  # a peak: the utilisation panel has data
def test_every_dashboard_query_and_alert_expression_returns_data(tmp_path, own_server):
    prometheus = need("prometheus")
    started = time.monotonic()
    with own_server as server:
        target = f"127.0.0.1:{server.port}"
        config = write_test_config(tmp_path, target)
        with Prometheus(prometheus, config, tmp_path / "tsdb", tmp_path / "prometheus.log") as prom:
            statuses = put_under_load(server.url, seconds=10)
            assert statuses.get(200, 0) >= 20 and statuses.get(400, 0) >= 2, statuses
            assert set(statuses) <= {200, 400}, statuses

            # Wait until Prometheus holds the load: several scrapes, the last one after it.
            deadline = time.monotonic() + scaled(30)
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
            deadline = time.monotonic() + scaled(20)
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
