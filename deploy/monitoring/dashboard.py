"""Writes sluice's Grafana dashboard (`sluice-dashboard.json` beside this file) from the panel list
below, and the Kubernetes objects that install it and `alerts.yaml` with the Prometheus Operator
and Grafana's dashboard sidecar (`deploy/kubernetes/monitoring/`, and the Helm chart's `files/`).

    python deploy/monitoring/dashboard.py            # after changing a panel or an alert

Edit the panels here and the alerts in alerts.yaml, not the generated files: `tests/test_monitoring.py`
checks that they agree, that every metric a query names is one sluice exports, and, with a real
Prometheus scraping a real server, that every query runs and that those of the serving path
return data.

Queries use three Grafana variables: `$datasource` (a Prometheus data source), `$model` and
`$tenant` (multi-valued, "All" = `.*`), and Grafana's `$__rate_interval`.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

PATH = Path(__file__).with_name("sluice-dashboard.json")
ALERTS = Path(__file__).with_name("alerts.yaml")
KUBERNETES = Path(__file__).parents[1] / "kubernetes" / "monitoring"
CHART_FILES = Path(__file__).parents[1] / "helm" / "sluice" / "files"
"""The Helm chart's copies (a chart reads only files inside its own folder)."""
GENERATED = "# Written by deploy/monitoring/dashboard.py from {source}: edit that and rerun it.\n"
PART_OF = {"app.kubernetes.io/part-of": "sluice"}
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
M = 'model=~"$model"'
T = 'tenant=~"$tenant"'


def _quantiles(metric: str, by: str, selector: str, qs: tuple[float, ...] = (0.5, 0.99)) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{{{selector}}}[{RATE}])))",
             f"{{{{{by}}}}} p{round(q * 100)}") for q in qs]


def _mean(metric: str, by: str, selector: str) -> str:
    return (f"sum by ({by}) (rate({metric}_sum{{{selector}}}[{RATE}]))"
            f" / sum by ({by}) (rate({metric}_count{{{selector}}}[{RATE}]))")


@dataclass
class Panel:
    title: str
    description: str
    targets: list[tuple[str, str]]  # (PromQL, legend)
    unit: str = "short"
    kind: str = "timeseries"
    width: int = 8
    stack: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


ROWS: list[tuple[str, list[Panel]]] = [
    ("Requests", [
        Panel("Requests by outcome", "Answers per second: ok, rejected (overload: 429/503 with Retry-After), "
              "expired (deadline, 504), invalid (the client's input), failed (device or worker), unavailable, "
              "cancelled (the client went away), error (an internal error: 500).",
              [(f"sum by (outcome) (rate(sluice_requests_total{{{M}}}[{RATE}]))", "{{outcome}}")],
              unit="reqps", stack=True),
        Panel("Served within the platform's control", "ok / (all answers - invalid - cancelled): the share of "
              "the requests sluice could have served that it did.",
              [(f'sum(rate(sluice_requests_total{{{M}, outcome="ok"}}[{RATE}])) / sum(rate(sluice_requests_total'
                f'{{{M}, outcome!~"invalid|cancelled"}}[{RATE}]))', "served")],
              unit="percentunit", kind="stat", width=4),
        Panel("Workers ready", "Workers connected to a gateway with their models warm (the highest of the "
              "gateways'), and worker processes restarted in the last hour.",
              [("max(sluice_workers_ready)", "ready"),
               ("sum(increase(sluice_worker_restarts_total[1h]))", "restarts (1 h)")], kind="stat", width=4),
        Panel("Latency of successful requests", "From admission at the gateway to the answer.",
              _quantiles("sluice_request_duration_seconds", "model", f'{M}, outcome="ok"'), unit="s"),
        Panel("Refused for overload", "Share of each model's answers that were refusals for overload (503 or "
              "429 with Retry-After, answered at once instead of queued to miss their deadline).",
              [(f'sum by (model) (rate(sluice_requests_total{{{M}, outcome="rejected"}}[{RATE}])) / sum by (model) '
                f"(rate(sluice_requests_total{{{M}}}[{RATE}]))", "{{model}} refused share")],
              unit="percentunit"),
        Panel("Result cache", "Cacheable requests by how they were answered: a stored answer (hit), an identical "
              "request's run (coalesced), or a device (miss).",
              [(f"sum by (result) (rate(sluice_cache_lookups_total{{{M}}}[{RATE}]))", "{{result}}")],
              unit="reqps", stack=True),
        Panel("Device failures and re-dispatches", "Items that failed inside a model, requests sent to another "
              "replica after a device failure, and requests sent again after their worker died.",
              [(f"sum by (model) (rate(sluice_item_failures_total{{{M}}}[{RATE}]))", "{{model}} item failures"),
               (f"sum by (model) (rate(sluice_retried_requests_total{{{M}}}[{RATE}]))", "{{model}} retried"),
               (f"sum(rate(sluice_redispatched_requests_total[{RATE}]))", "re-dispatched")], unit="reqps"),
    ]),
    ("Batching and devices", [
        Panel("Device busy", "Fraction of the last few seconds each worker's device was executing.",
              [("max by (worker) (sluice_device_busy_ratio)", "worker {{worker}}")], unit="percentunit",
              extra={"max": 1}),
        Panel("Devices the offered load needs", "Device-seconds used per second plus those refused for "
              "overload: above the number of workers, the fleet is short (what the KEDA overlay scales on).",
              [(f"sum(rate(sluice_device_busy_seconds_total[{RATE}])) + "
                f"(sum(rate(sluice_refused_work_seconds_total[{RATE}])) or vector(0))", "needed"),
               ("max(sluice_workers_ready)", "workers")]),
        Panel("Mean batch size", "Items per executed batch: the batching at work.",
              [(_mean("sluice_batch_size", "model", M), "{{model}}")]),
        Panel("Queue wait", "Time items waited in a worker's queue before their batch started.",
              _quantiles("sluice_queue_wait_seconds", "model", M), unit="s"),
        Panel("Batch execution", "Device time of one batch.",
              _quantiles("sluice_batch_execution_seconds", "model", M), unit="s"),
        Panel("Queued work", "Predicted device-seconds queued on the workers, per model: what admission "
              "compares with each request's deadline.",
              [(f"sum by (model) (sluice_queued_work_seconds{{{M}}})", "{{model}}")], unit="s"),
    ]),
    ("Tenants", [
        Panel("Admitted", "Requests admitted past each tenant's limits, by priority class.",
              [(f"sum by (tenant, class) (rate(sluice_tenant_admitted_total{{{T}}}[{RATE}]))", "{{tenant}} {{class}}")],
              unit="reqps"),
        Panel("Refused", "Requests refused per tenant before admission, by the limit that refused them "
              "(requests, tokens, concurrency, credits) or by the gateway (overloaded, expired). Admitted "
              "requests that end otherwise are under Requests by outcome.",
              [(f"sum by (tenant, reason) (rate(sluice_tenant_rejected_total{{{T}}}[{RATE}]))",
                "{{tenant}} {{reason}}")],
              unit="reqps"),
        Panel("Goodput", "Requests completed successfully within their deadline.",
              [(f"sum by (tenant, class) (rate(sluice_tenant_goodput_total{{{T}}}[{RATE}]))", "{{tenant}} {{class}}")],
              unit="reqps"),
        Panel("Share of device time", "Each tenant's share of the device-seconds used: with every tenant "
              "saturating, it follows the weights in the tenants file.",
              [(f"sum by (tenant) (rate(sluice_tenant_device_seconds_total{{{T}}}[{RATE}])) / ignoring (tenant) "
                f"group_left sum(rate(sluice_tenant_device_seconds_total[{RATE}]))", "{{tenant}}")],
              unit="percentunit", stack=True),
        Panel("Queue wait by tenant", "p99 of the time each tenant's requests waited in a worker's queue.",
              _quantiles("sluice_tenant_queue_wait_seconds", "tenant", T, (0.99,)), unit="s"),
        Panel("Device-seconds used", "Device time charged to each tenant (what credit budgets count).",
              [(f"sum by (tenant) (rate(sluice_tenant_device_seconds_total{{{T}}}[{RATE}]))", "{{tenant}}")],
              unit="s"),
    ]),
    ("Generation", [
        Panel("Time to first token", "From arrival to the first streamed output.",
              _quantiles("sluice_time_to_first_token_seconds", "model", M), unit="s"),
        Panel("Inter-token latency", "Between consecutive streamed outputs of one request (p99), and time per "
              "output token after the first (p50).",
              [*_quantiles("sluice_inter_token_latency_seconds", "model", M, (0.99,)),
               *_quantiles("sluice_time_per_output_token_seconds", "model", M, (0.5,))], unit="s"),
        Panel("Tokens", "Prompt tokens (of them, those found in the prefix cache) and generated tokens per second.",
              [(f"sum by (model) (rate(sluice_prompt_tokens_total{{{M}}}[{RATE}]))", "{{model}} prompt"),
               (f"sum by (model) (rate(sluice_cached_prompt_tokens_total{{{M}}}[{RATE}]))", "{{model}} cached prompt"),
               (f"sum by (model) (rate(sluice_generation_tokens_total{{{M}}}[{RATE}]))", "{{model}} generated")]),
        Panel("Sequences", "Sequences running in the engines (holding KV blocks) and waiting for blocks or a slot.",
              [('sum by (model_name) (vllm:num_requests_running{model_name=~"$model"})',
                "{{model_name}} running"),
               ('sum by (model_name) (vllm:num_requests_waiting{model_name=~"$model"})',
                "{{model_name}} waiting")]),
        Panel("KV cache", "Fraction of the KV cache's blocks in use (the fullest worker), and sequences "
              "preempted per second (freed, recomputed later) when it runs out.",
              [('max by (model_name) (vllm:kv_cache_usage_perc{model_name=~"$model"})',
                "{{model_name}} in use"),
               (f"sum by (model) (rate(sluice_preemptions_total{{{M}}}[{RATE}]))", "{{model}} preemptions/s")],
              unit="percentunit"),
        Panel("Prefix cache hit rate", "Prompt tokens found in the prefix cache over those looked up.",
              [(f"sum by (model) (rate(sluice_prefix_cache_hits_total{{{M}}}[{RATE}])) / sum by (model) "
                f"(rate(sluice_prefix_cache_queries_total{{{M}}}[{RATE}]))", "{{model}}")], unit="percentunit"),
    ]),
    ("Versions and batch jobs", [
        Panel("Traffic share", "Share of each model's unversioned requests sent to each version: its split, "
              "or its canary's current step.",
              [(f"max by (model, version) (sluice_traffic_share{{{M}}})", "{{model}} v{{version}}")],
              unit="percentunit"),
        Panel("Canary events", "Canary steps passed, canaries promoted and rolled back.",
              [(f"sum by (model, event) (increase(sluice_canary_events_total{{{M}}}[{RATE}]))",
                "{{model}} {{event}}")]),
        Panel("Batch job items", "Batch-job items finished per second, by outcome; items still to do.",
              [(f"sum by (outcome) (rate(sluice_batch_items_total[{RATE}]))", "{{outcome}}"),
               ('max(sluice_batch_items_pending{state="queued"})', "queued"),
               ('sum(sluice_batch_items_pending{state="running"})', "running")]),
        Panel("Background responses", "Background responses (/v1/responses, background: true) ended per second, "
              "by status; running now, and taken over from a gateway that stopped.",
              [(f"sum by (status) (rate(sluice_background_responses_total[{RATE}]))", "{{status}}"),
               ("sum(sluice_background_responses_running)", "running"),
               (f"sum(increase(sluice_background_responses_taken_over_total[{RATE}]))", "taken over")]),
    ]),
]


def _panel(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": panel.unit, **panel.extra}
    if panel.kind == "timeseries":
        defaults["custom"] = {"fillOpacity": 20 if panel.stack else 0, "showPoints": "never",
                              "stacking": {"mode": "normal" if panel.stack else "none", "group": "A"}}
    return {
        "id": panel_id, "type": panel.kind, "title": panel.title, "description": panel.description,
        "datasource": DATASOURCE, "gridPos": {"h": 8, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": ({"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                     "tooltip": {"mode": "multi", "sort": "desc"}} if panel.kind == "timeseries"
                    else {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                          "colorMode": "value", "graphMode": "area", "textMode": "auto"}),
        "targets": [{"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + i)}
                    for i, (expr, legend) in enumerate(panel.targets)],
    }


def _variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {"name": name, "label": label, "type": "query", "datasource": DATASOURCE,
            "query": {"query": query, "refId": name}, "definition": query, "refresh": 2, "sort": 1,
            "multi": True, "includeAll": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"}}


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    panel_id, y = 1, 0
    for title, row in ROWS:
        panels.append({"id": panel_id, "type": "row", "title": title, "collapsed": False, "panels": [],
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        panel_id, y, x = panel_id + 1, y + 1, 0
        for panel in row:
            if x + panel.width > 24:
                x, y = 0, y + 8
            panels.append(_panel(panel, panel_id, x, y))
            panel_id, x = panel_id + 1, x + panel.width
        y += 8
    return {
        "uid": "sluice-overview", "title": "sluice", "tags": ["sluice", "inference"],
        "description": "sluice's serving path, tenants, generation, versions and batch jobs, from its /metrics.",
        "schemaVersion": 39, "version": 1, "editable": True, "graphTooltip": 1,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "30s",
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}},
            _variable("model", "Model", "label_values(sluice_requests_total, model)"),
            _variable("tenant", "Tenant", "label_values(sluice_tenant_admitted_total, tenant)"),
        ]},
        "annotations": {"list": [{
            "name": "Canary rollbacks", "enable": True, "iconColor": "red", "datasource": DATASOURCE,
            "expr": "sum by (model) (increase(sluice_canary_events_total{event=\"rolled_back\"}[1m])) > 0",
            "titleFormat": "{{model}}: canary rolled back", "step": "60s",
        }]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def dashboard_config_map() -> str:
    """The dashboard as a ConfigMap that Grafana's sidecar (the kube-prometheus-stack chart's) loads."""
    config_map = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "sluice-grafana-dashboard", "labels": {"grafana_dashboard": "1", **PART_OF}},
        "data": {"sluice-dashboard.json": render()},
    }
    return GENERATED.format(source="its panels") + yaml.safe_dump(config_map, sort_keys=False, width=120)


def prometheus_rule() -> str:
    """alerts.yaml as the Prometheus Operator's PrometheusRule."""
    rule = {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
        "metadata": {"name": "sluice-alerts", "labels": PART_OF},
        "spec": yaml.safe_load(ALERTS.read_text()),
    }
    return GENERATED.format(source="deploy/monitoring/alerts.yaml") + yaml.safe_dump(rule, sort_keys=False,
                                                                                        width=120)


def outputs() -> dict[Path, str]:
    return {PATH: render(), KUBERNETES / "grafana-dashboard.yaml": dashboard_config_map(),
            KUBERNETES / "prometheus-rule.yaml": prometheus_rule(),
            CHART_FILES / "sluice-dashboard.json": render(), CHART_FILES / "alerts.yaml": ALERTS.read_text()}


if __name__ == "__main__":
    for path, text in outputs().items():
        path.write_text(text)
        sys.stdout.write(f"wrote {path}\n")
