"""The Grafana dashboard and the Prometheus alerts in deploy/monitoring/.

A real Prometheus (Debian's `prometheus`, installed by ./scripts/test) scrapes the demo server
while it serves embeddings, tensors and streamed generations; every dashboard query and every
alert's expression then runs on what it scraped. `promtool` checks the rules and runs their
unit tests (alerts_test.yaml).
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import httpx
import prometheus_client
import pytest
import yaml

from sluice import metrics
from tests.conftest import ServerProcess, eventually, free_port

MONITORING = Path(__file__).parents[1] / "deploy" / "monitoring"
METRIC_NAME = re.compile(r"\b(?:sluice_\w+|vllm:\w+)")
RATE_WINDOW = "20s"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sluice_dashboard", MONITORING / "dashboard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def _dashboard() -> dict:
    return json.loads((MONITORING / "sluice-dashboard.json").read_text())


def _panel_queries() -> dict[str, list[str]]:
    """Each panel's title and its queries, with Grafana's variables given the values of 'All'."""
    queries = {}
    for panel in _dashboard()["panels"]:
        if panel["type"] != "row":
            queries[panel["title"]] = [_as_prometheus(target["expr"]) for target in panel["targets"]]
    return queries


def _as_prometheus(expr: str) -> str:
    return (expr.replace("$__rate_interval", RATE_WINDOW).replace('"$model"', '".*"')
            .replace('"$tenant"', '".*"'))


def _alerts() -> dict[str, str]:
    rules = yaml.safe_load((MONITORING / "alerts.yaml").read_text())
    return {rule["alert"]: rule["expr"] for group in rules["groups"] for rule in group["rules"]}


def _promtool() -> str:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.fail("promtool is not installed (Debian's prometheus package); ./scripts/test installs it")
    return binary


def test_the_generated_files_are_what_the_generator_writes():
    outputs = _generator().outputs()
    root = MONITORING.parents[1]
    assert {str(path.relative_to(root)) for path in outputs} == {
        "deploy/monitoring/sluice-dashboard.json", "deploy/kubernetes/monitoring/grafana-dashboard.yaml",
        "deploy/kubernetes/monitoring/prometheus-rule.yaml", "deploy/helm/sluice/files/sluice-dashboard.json",
        "deploy/helm/sluice/files/alerts.yaml"}
    for path, text in outputs.items():
        assert path.read_text() == text, f"{path} is out of date: run python deploy/monitoring/dashboard.py"


def test_the_dashboard_is_laid_out_on_grafanas_grid():
    dashboard = _dashboard()
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    occupied: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        box = panel["gridPos"]
        assert box["x"] + box["w"] <= 24, panel["title"]
        cells = {(x, y) for x in range(box["x"], box["x"] + box["w"]) for y in range(box["y"], box["y"] + box["h"])}
        assert not cells & occupied, f"{panel['title']} overlaps another panel"
        occupied |= cells
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}"
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "model", "tenant"}


def _exported_names() -> set[str]:
    """Every sample name sluice's /metrics can hold (a counter's `_total`, a histogram's `_bucket`...)."""
    names: set[str] = set()
    for value in vars(metrics).values():
        if isinstance(value, prometheus_client.Counter):
            names.add(f"{value._name}_total")
        elif isinstance(value, prometheus_client.Histogram):
            names.update(f"{value._name}_{suffix}" for suffix in ("bucket", "sum", "count"))
        elif isinstance(value, prometheus_client.Gauge):
            names.add(value._name)
    return names


def test_every_metric_the_dashboard_and_alerts_name_is_one_sluice_exports():
    exported = _exported_names()
    assert "sluice_requests_total" in exported and "vllm:kv_cache_usage_perc" in exported
    texts = [json.dumps(_dashboard()), *_alerts().values()]
    named = {name for text in texts for name in METRIC_NAME.findall(text)}
    assert named - exported == set(), "renamed or never exported"
    assert len(named) >= 35


def test_alert_rules_are_valid_and_pass_their_unit_tests():
    promtool = _promtool()
    checked = subprocess.run([promtool, "check", "rules", "alerts.yaml"], cwd=MONITORING, capture_output=True,
                             text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"{len(_alerts())} rules found" in checked.stdout
    tested = subprocess.run([promtool, "test", "rules", "alerts_test.yaml"], cwd=MONITORING, capture_output=True,
                            text=True, timeout=60)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    tests = yaml.safe_load((MONITORING / "alerts_test.yaml").read_text())["tests"]
    fired = {case["alertname"] for test in tests for case in test["alert_rule_test"] if case["exp_alerts"]}
    assert fired == set(_alerts()), "every alert is shown firing at least once"


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str) -> list[dict]:
        answer = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10).json()
        assert answer["status"] == "success", f"{expr}: {answer.get('error')}"
        return answer["data"]["result"]


@pytest.fixture
def prometheus(demo_server: ServerProcess, tmp_path: Path) -> Iterator[Prometheus]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus is not installed (Debian's prometheus package); ./scripts/test installs it")
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "sluice", "static_configs": [
            {"targets": [demo_server.url.removeprefix("http://")]}]}],
    }))
    port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    process = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                                f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                               stdout=log, stderr=subprocess.STDOUT)
    server = Prometheus(f"http://127.0.0.1:{port}")
    try:
        eventually(lambda: httpx.get(f"{server.url}/-/ready").status_code == 200, "Prometheus to start")
        eventually(lambda: server.query('up{job="sluice"} == 1') != [], "Prometheus to scrape sluice")
        yield server
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def _serve_traffic(url: str, seconds: float) -> None:
    """Embeddings (one repeated, for the result cache), tensors and streamed generations, spread over
    `seconds`, each with a roomy deadline: on a loaded test machine the demo models' short SLOs
    (minilm's 500 ms) turned some into 504s, which the dashboards rightly count as failures."""
    with httpx.Client(base_url=url, timeout=60, headers={"X-Request-Timeout-Ms": "30000"}) as client:
        ends = time.monotonic() + seconds
        i = 0
        while time.monotonic() < ends:
            answer = client.post("/v2/models/emulated/infer", json={"inputs": [
                {"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [float(i)] * 16}]})
            assert answer.status_code == 200, answer.text
            answer = client.post("/v1/embeddings", json={"model": "minilm", "input": ["monitoring", f"line {i}"]})
            assert answer.status_code == 200, answer.text
            if i % 4 == 0:
                with client.stream("POST", "/v1/completions", json={
                        "model": "tiny-lm", "prompt": PROMPT, "max_tokens": 8, "stream": True,
                        "stream_options": {"include_usage": True}}) as stream:
                    assert stream.status_code == 200
                    assert any(line == "data: [DONE]" for line in stream.iter_lines())
            i += 1
            time.sleep(0.05)


PROMPT = "Watching a fleet of inference workers from one dashboard, " * 4
"""Several KV blocks long, so that repeating it hits the prefix cache."""

# Panels that any server serving requests must fill; the others need what this test does not
# cause (overload refusals, device failures, tenants' limits, canaries, batch jobs, preemptions).
SERVING_PANELS = {
    "Requests by outcome", "Served within the platform's control", "Workers ready", "Latency of successful requests",
    "Result cache", "Device busy", "Devices the offered load needs", "Mean batch size", "Queue wait",
    "Batch execution", "Queued work", "Admitted", "Goodput", "Share of device time", "Queue wait by tenant",
    "Device-seconds used", "Time to first token", "Inter-token latency", "Tokens", "Sequences", "KV cache",
    "Prefix cache hit rate",
}


def _values(result: list[dict]) -> list[float]:
    return [float(series["value"][1]) for series in result]


def test_every_query_runs_on_a_real_prometheus_scraping_a_real_server(prometheus, demo_server):
    _serve_traffic(demo_server.url, seconds=4.0)
    scraped_after = time.time() + 2.5
    eventually(lambda: any(v >= scraped_after for v in _values(prometheus.query('timestamp(up{job="sluice"})'))),
               "Prometheus to scrape after the traffic")
    queries = _panel_queries()
    assert set(queries) >= SERVING_PANELS
    for title, exprs in queries.items():
        for expr in exprs:
            result = prometheus.query(expr)  # every query is valid PromQL
            if title in SERVING_PANELS and expr is exprs[0]:
                assert any(math.isfinite(v) for v in _values(result)), f"{title}: no data from {expr}"

    outcomes = prometheus.query(queries["Requests by outcome"][0])
    by_outcome = {series["metric"]["outcome"]: float(series["value"][1]) for series in outcomes}
    assert by_outcome.get("ok", 0) > 0
    [served] = _values(prometheus.query(queries["Served within the platform's control"][0]))
    assert served == 1.0, "nothing was refused or failed"
    [hit_rate] = _values(prometheus.query(queries["Prefix cache hit rate"][0]))
    assert 0 < hit_rate < 1, "the repeated prompt's full blocks were found in the prefix cache"
    [share] = prometheus.query(queries["Share of device time"][0])
    assert share["metric"]["tenant"] == "local" and float(share["value"][1]) == pytest.approx(1.0)
    batch_sizes = _values(prometheus.query(queries["Mean batch size"][0]))
    assert all(size >= 1 for size in batch_sizes if math.isfinite(size))
    models = {s["metric"]["model"] for s in prometheus.query(queries["Latency of successful requests"][-1])}
    assert {"emulated", "minilm", "tiny-lm"} <= models
    variable = next(v for v in _dashboard()["templating"]["list"] if v["name"] == "model")["definition"]
    assert variable == "label_values(sluice_requests_total, model)"
    assert {s["model"] for s in httpx.get(f"{prometheus.url}/api/v1/series",
                                         params={"match[]": "sluice_requests_total"}).json()["data"]} >= models

    for alert, expr in _alerts().items():
        assert prometheus.query(expr) == [], f"{alert} fires on a healthy server"
