"""The Kubernetes manifests in `deploy/kubernetes` and the Helm chart in `deploy/helm/sluice`
(rendered by Helm's own engine): valid against the Kubernetes API's schemas, consistent with each
other (selectors, ports, scale targets), with commands and environment variables that the real
`sluice` command line accepts, with an autoscaling query over metrics sluice exports; the chart
the same objects as the manifests, its values checked, its releases apart from each other; and
the manifests' gateway and worker commands, run as local processes against a real Redis, make a
working cluster."""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click
import httpx
import jsonpatch
import kubernetes_validate
import numpy as np
import pytest
import redis
import tritonclient.grpc
import yaml

from sluice import cli
from tests.conftest import free_port, start_redis, stop_all, write_emulated_model

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
CHART = DEPLOY / "helm" / "sluice"
VARIANTS = ["base", "keda", "gpu", "monitoring"]
CHART_VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "gpu": {"worker": {"device": "cuda", "gpusPerWorker": 2, "tolerations": [{"key": "pool", "operator": "Exists"}]}},
    "keda": {"worker": {"autoscaling": {"enabled": True}}},
    "monitoring": {"monitoring": {"podMonitors": True, "prometheusRule": True, "grafanaDashboard": True,
                                  "labels": {"release": "kube-prometheus-stack"}}},
    "own-redis-and-models": {"redis": {"enabled": False, "external": {"existingSecret": "my-redis"}},
                             "worker": {"models": {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
                                        "extraArgs": ["--share", "0/1"]}},
    "one-gateway": {"jobs": {"database": {"enabled": False}}, "tenants": {"enabled": False},
                    "networkPolicies": {"enabled": False},
                    "gateway": {"replicas": 1, "autoscaling": {"enabled": False}, "grpc": {"enabled": False},
                                "extraArgs": ["--cache-mb", "512"],
                                "extraEnv": [{"name": "SLUICE_GATEWAY_CACHE_MB", "value": "64"}]}},
}
SOURCES = [*(f"kustomize/{v}" for v in VARIANTS), *(f"helm/{v}" for v in CHART_VARIANTS)]
HELM_LABELS = {"helm.sh/chart", "app.kubernetes.io/instance", "app.kubernetes.io/managed-by",
               "app.kubernetes.io/version"}
"""Labels the chart adds to the manifests' (its objects' release and version)."""
_HELM = """
import json, sys
import helm_python

chart, values, release, namespace = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
lint = helm_python.lint(chart, values, strict=True, kube_version="v1.30.0")
rendered = helm_python.Chart.load(chart).render(values, name=release, namespace=namespace, is_install=True)
json.dump({"lint": lint, "rendered": rendered}, sys.stdout)
"""
CUSTOM_RESOURCES = ("keda.sh/", "monitoring.coreos.com/")
"""API groups of the operators' CRDs, which the Kubernetes schemas do not know: checked by their own tests."""
KUBERNETES_VERSION = "1.30.0"
SUPPORTED_KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "patches"}


def render(folder: Path) -> list[dict[str, Any]]:
    """What `kubectl kustomize folder` gives for the subset of kustomize these manifests use
    (resources, and JSON 6902 patches with a target): checked against kubectl where it is installed."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert set(kustomization) <= SUPPORTED_KUSTOMIZATION_KEYS, set(kustomization) - SUPPORTED_KUSTOMIZATION_KEYS
    documents: list[dict[str, Any]] = []
    for resource in kustomization.get("resources", []):
        path = (folder / resource).resolve()
        documents += render(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in kustomization.get("patches", []):
        target = patch["target"]
        operations = yaml.safe_load((folder / patch["path"]).read_text())
        matches = [i for i, d in enumerate(documents)
                   if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"]]
        assert len(matches) == 1, target
        documents[matches[0]] = jsonpatch.apply_patch(documents[matches[0]], operations)
    return documents


class HelmError(Exception):
    """Helm refused the chart or its values (the message is Helm's)."""


def helm_template(values: dict[str, Any], release: str = "sluice", namespace: str = "default") -> list[dict[str, Any]]:
    """`helm template` of the chart, by Helm's own Go engine (the helm-python-sdk package, run in a
    child process so its Go runtime stays out of pytest's), after `helm lint --strict` found nothing."""
    done = subprocess.run([sys.executable, "-c", _HELM, str(CHART), json.dumps(values), release, namespace],
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise HelmError(done.stderr)
    result = json.loads(done.stdout)
    problems = [m for m in result["lint"]["messages"] if m["severity"] >= 2]
    assert not problems and not result["lint"]["errors"], (problems, result["lint"]["errors"])
    return [d for path, text in sorted(result["rendered"].items()) if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]


def documents_of(source: str) -> list[dict[str, Any]]:
    """The objects of `kustomize/VARIANT` or `helm/VARIANT` (CHART_VARIANTS' values)."""
    kind, variant = source.split("/")
    return render(KUBERNETES / variant) if kind == "kustomize" else helm_template(CHART_VARIANTS[variant])


def without_release_labels(document: Any) -> Any:
    """The object with the chart's own labels taken out of every label set and selector."""
    if isinstance(document, dict):
        return {key: ({k: v for k, v in value.items() if k not in HELM_LABELS} if _is_label_set(key, value)
                      else without_release_labels(value)) for key, value in document.items()}
    if isinstance(document, list):
        return [without_release_labels(item) for item in document]
    return document


def _is_label_set(key: str, value: Any) -> bool:
    return (key in ("labels", "matchLabels", "selector") and isinstance(value, dict)
            and all(isinstance(v, str) for v in value.values()))


def by_kind(documents: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in documents if d["kind"] == kind}


def workloads(documents: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Deployments and StatefulSets, by name."""
    return {**by_kind(documents, "Deployment"), **by_kind(documents, "StatefulSet")}


def containers(documents: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every workload's containers, by container name."""
    return {c["name"]: c for d in workloads(documents).values() for c in d["spec"]["template"]["spec"]["containers"]}


@pytest.mark.parametrize("source", SOURCES)
def test_manifests_are_valid_kubernetes_objects(source: str) -> None:
    documents = documents_of(source)
    for document in documents:
        if document["apiVersion"].startswith(CUSTOM_RESOURCES):
            continue  # a CRD: checked by test_workers_autoscale_on_demand_that_sluice_exports and the next
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    names = [(d["kind"], d["metadata"]["name"]) for d in documents]
    assert len(names) == len(set(names)), names
    kind, variant = source.split("/")
    if kind == "kustomize" and shutil.which("kubectl"):  # the renderer above agrees with kustomize itself
        built = subprocess.run(["kubectl", "kustomize", str(KUBERNETES / variant)], capture_output=True, text=True,
                               check=True).stdout
        key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
        assert sorted(yaml.safe_load_all(built), key=key) == sorted(documents, key=key)


@pytest.mark.parametrize("source", ["kustomize/monitoring", "helm/monitoring"])
def test_the_monitoring_overlay_scrapes_every_pod_and_installs_the_alerts_and_dashboard(source: str) -> None:
    documents = documents_of(source)
    pods = {name: d["spec"]["template"] for name, d in workloads(documents).items()}
    scraped = set()
    for monitor in by_kind(documents, "PodMonitor").values():
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        [(name, pod)] = [(name, pod) for name, pod in pods.items()
                         if monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()]
        ports = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
            assert str(ports[endpoint["port"]]) == pod["metadata"]["annotations"]["prometheus.io/port"]
        scraped.add(name)
    assert scraped == {"sluice-gateway", "sluice-worker"}, "every pod that serves /metrics, and not Redis"
    [rule] = by_kind(documents, "PrometheusRule").values()
    assert rule["spec"] == yaml.safe_load((DEPLOY / "monitoring" / "alerts.yaml").read_text())
    [dashboard] = by_kind(documents, "ConfigMap").values()
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["data"]["sluice-dashboard.json"] == (DEPLOY / "monitoring" / "sluice-dashboard.json").read_text()


@pytest.mark.parametrize("source", SOURCES)
def test_selectors_ports_and_targets_agree(source: str) -> None:
    documents = documents_of(source)
    deployments = workloads(documents)
    for deployment in deployments.values():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in container:
                    check = container[probe].get("httpGet") or container[probe]["tcpSocket"]
                    assert check["port"] in ports or check["port"] in ports.values(), (container["name"], probe)
    pods = [d["spec"]["template"] for d in deployments.values()]
    for service in by_kind(documents, "Service").values():
        selected = [p for p in pods if service["spec"]["selector"].items() <= p["metadata"]["labels"].items()]
        assert len(selected) == 1, service["metadata"]["name"]
        port_names = {p["name"] for c in selected[0]["spec"]["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names
    for budget in by_kind(documents, "PodDisruptionBudget").values():
        assert any(budget["spec"]["selector"]["matchLabels"].items() <= p["metadata"]["labels"].items() for p in pods)
    for policy in by_kind(documents, "NetworkPolicy").values():  # it guards a pod, by ports the pod has
        selected = [p for p in pods if policy["spec"]["podSelector"]["matchLabels"].items()
                    <= p["metadata"]["labels"].items()]
        assert len(selected) == 1, policy["metadata"]["name"]
        port_names = {p["name"] for c in selected[0]["spec"]["containers"] for p in c["ports"]}
        for rule in policy["spec"]["ingress"]:
            assert {p["port"] for p in rule["ports"]} <= port_names
            for peer in rule.get("from", []):  # and lets in pods that exist
                assert any(peer["podSelector"]["matchLabels"].items() <= p["metadata"]["labels"].items()
                           for p in pods if p is not selected[0])
    for stateful in by_kind(documents, "StatefulSet").values():
        assert stateful["spec"]["serviceName"] in by_kind(documents, "Service")
        claims = {t["metadata"]["name"] for t in stateful["spec"].get("volumeClaimTemplates", [])}
        mounted = {m["name"] for c in stateful["spec"]["template"]["spec"]["containers"]
                   for m in c.get("volumeMounts", [])}
        assert claims <= mounted
    for autoscaler in [*by_kind(documents, "HorizontalPodAutoscaler").values(),
                       *by_kind(documents, "ScaledObject").values()]:
        assert autoscaler["spec"]["scaleTargetRef"]["name"] in deployments


def _arguments(container: dict[str, Any], values: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The container's args and environment (`valueFrom`: `values`) with `$(VAR)` expanded as
    Kubernetes does: in a variable's value, from the variables defined before it."""
    def expand(text: str) -> str:
        return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], text)

    env: dict[str, str] = {}
    for variable in container.get("env", []):
        env[variable["name"]] = expand(variable["value"]) if "value" in variable else values.get(variable["name"], "x")
    return [expand(a) for a in container["args"]], env


@pytest.mark.parametrize("source", SOURCES)
def test_commands_and_environment_are_what_the_cli_accepts(source: str, monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text("")
    values = {"POD_NAME": "sluice-worker-abc", "POD_IP": "10.1.2.3", "SLUICE_GATEWAY_JOBS_DB": "postgresql://db/x",
              "REDIS_URL": "rediss://:secret@redis.example:6380/2"}
    sluice_containers = {name: c for name, c in containers(documents_of(source)).items()
                         if c["image"].startswith("sluice")}
    assert set(sluice_containers) == {"gateway", "worker"}
    for container in sluice_containers.values():
        args, env = _arguments(container, values)
        args = [str(tenants) if a == "/etc/sluice/tenants.toml" else a for a in args]
        command = cli.main.get_command(click.Context(cli.main), args[0])
        assert command is not None, args
        options = {p.envvar for p in command.params}
        for name, value in env.items():
            assert not name.startswith(f"SLUICE_{args[0].upper()}_") or name in options, name  # else silently unused
            monkeypatch.setenv(name, value)
        with cli.main.make_context("sluice", list(args)) as group:
            parsed = command.make_context(args[0], args[1:], parent=group)  # option types and callbacks run
        redis_url = (values["REDIS_URL"] if source == "helm/own-redis-and-models"
                     else f"redis://:{values.get('REDIS_PASSWORD', 'x')}@sluice-redis:6379/0")
        if args[0] == "worker":
            assert parsed.params["registry"] == env["SLUICE_WORKER_REGISTRY"] == redis_url
            assert parsed.params["device"] == ("cuda" if source.endswith("/gpu") else "cpu")
            assert parsed.params["advertise"] == "tcp://10.1.2.3:7000"
        else:
            assert parsed.params["jobs_db"] == (None if source == "helm/one-gateway" else "postgresql://db/x")
            assert parsed.params["registry"] == parsed.params["limits_redis"] == redis_url
            assert parsed.params["cache_redis"] == redis_url
        monkeypatch.undo()


@pytest.mark.parametrize("source", ["kustomize/keda", "helm/keda"])
def test_workers_autoscale_on_demand_that_sluice_exports(source: str) -> None:
    documents = documents_of(source)
    (scaled,) = by_kind(documents, "ScaledObject").values()
    assert "replicas" not in by_kind(documents, "Deployment")["sluice-worker"]["spec"] or source.startswith("kustomize")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"]["name"] == "sluice-worker"
    assert 1 <= scaled["spec"]["minReplicaCount"] < scaled["spec"]["maxReplicaCount"]
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and 0 < float(trigger["metadata"]["threshold"]) <= 1
    from sluice import metrics

    exported = {f"{m._name}_total" if m._type == "counter" else m._name
                for m in vars(metrics).values() if hasattr(m, "_type") and hasattr(m, "_name")}
    queried = set(re.findall(r"\b(sluice_\w+)", trigger["metadata"]["query"]))
    assert queried == {"sluice_device_busy_seconds_total", "sluice_refused_work_seconds_total"}
    assert queried <= exported
    # defined before any refusal, but no busy series at all (not scraped) is an error, not 0
    assert re.search(r"refused_work_seconds_total(\{[^}]*\})?\[2m\]\)\) or vector\(0\)", trigger["metadata"]["query"])
    assert trigger["metadata"]["query"].count("or vector(0)") == 1
    assert trigger["metadata"]["ignoreNullValues"] == "false"
    if source.startswith("helm"):  # a release counts its own pods' series only, both of them
        selectors = re.findall(r"\{([^}]*)\}", trigger["metadata"]["query"])
        assert len(selectors) == 2 and len(set(selectors)) == 1, selectors
        pods = re.search(r'namespace="default", pod=~"([^"]+)"', selectors[0])
        assert pods is not None, selectors
        for pod, counted in [("sluice-worker-6d4cf56db6-x2x7k", True), ("sluice-gateway-6d4cf56db6-abcde", True),
                             ("sluice-redis-0", False), ("other-sluice-worker-6d4cf-x2x7k", False)]:
            assert bool(re.fullmatch(pods.group(1), pod)) == counted, pod


def test_the_image_pins_the_same_torch_as_the_package() -> None:
    pyproject = (DEPLOY.parent / "pyproject.toml").read_text()
    pin = re.search(r'"torch==([\d.]+)"', pyproject)
    assert pin is not None
    assert f"torch=={pin.group(1)}" in (DEPLOY / "Dockerfile").read_text()


@pytest.mark.parametrize(("variant", "values"), [
    ("base", {}),
    ("gpu", {"worker": {"device": "cuda"}}),
    ("monitoring", {"monitoring": {"podMonitors": True, "prometheusRule": True, "grafanaDashboard": True}}),
])
def test_the_chart_installed_as_sluice_makes_the_manifests_objects(variant: str, values: dict[str, Any]) -> None:
    """`helm install sluice deploy/helm/sluice` makes what `kubectl apply -k deploy/kubernetes/VARIANT`
    does, with its release's labels, plus the Secret of Redis's password that the manifests leave
    to the user: one deployment, two ways to install it."""
    chart = {(d["kind"], d["metadata"]["name"]): d for d in helm_template(values)}
    manifests = {(d["kind"], d["metadata"]["name"]): d for d in render(KUBERNETES / variant)}
    assert set(chart) - set(manifests) == {("Secret", "sluice-redis")}
    assert set(manifests) <= set(chart)
    for key, manifest in manifests.items():
        assert without_release_labels(chart[key]) == manifest, key
        labels = chart[key]["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == "sluice" and labels["app.kubernetes.io/managed-by"] == "Helm"
    password = base64.b64decode(chart["Secret", "sluice-redis"]["data"]["password"]).decode()
    assert re.fullmatch("[0-9a-f]{64}", password)  # safe in a redis:// URL, as the manifests ask of theirs


def test_two_releases_in_one_namespace_stay_apart() -> None:
    blue, green = helm_template({}, release="blue"), helm_template({}, release="green")
    assert not {(d["kind"], d["metadata"]["name"]) for d in blue} & {(d["kind"], d["metadata"]["name"]) for d in green}
    green_pods = [w["spec"]["template"]["metadata"]["labels"] for w in workloads(green).values()]
    selectors = [d["spec"]["selector"]["matchLabels"] for d in workloads(blue).values()]
    selectors += [d["spec"]["selector"] for d in by_kind(blue, "Service").values()]
    selectors += [d["spec"]["selector"]["matchLabels"] for d in by_kind(blue, "PodDisruptionBudget").values()]
    for policy in by_kind(blue, "NetworkPolicy").values():
        selectors.append(policy["spec"]["podSelector"]["matchLabels"])
        selectors += [peer["podSelector"]["matchLabels"] for rule in policy["spec"]["ingress"]
                      for peer in rule.get("from", [])]
    assert len(selectors) == 11  # 3 workloads, 2 Services, 2 budgets, 2 policies and their peers
    for selector in selectors:
        assert not any(selector.items() <= labels.items() for labels in green_pods), selector
    gateway = containers(blue)["gateway"]
    urls = [e["value"] for e in gateway["env"] if e.get("value", "").startswith("redis://")]
    assert len(urls) == 3 and all("@blue-sluice-redis:6379/" in url for url in urls)
    named = helm_template({}, release="sluice-prod")[0]["metadata"]["name"]
    assert named.startswith("sluice-prod-") and not named.startswith("sluice-prod-sluice")


@pytest.mark.parametrize(("values", "refusal"), [
    ({"worker": {"device": "tpu"}}, "at '/worker/device'"),
    ({"gatway": {"replicas": 3}}, "additional properties 'gatway' not allowed"),
    ({"gateway": {"autoscaling": {"targetCPUUtilizationPercentage": 150}}},
     "at '/gateway/autoscaling/targetCPUUtilizationPercentage'"),
    ({"worker": {"autoscaling": {"prometheusServerAddress": "prometheus:9090"}}},
     "at '/worker/autoscaling/prometheusServerAddress'"),
    ({"jobs": {"database": {"enabled": False}}}, "only one gateway can run"),
    ({"redis": {"enabled": False}}, "redis.external.existingSecret"),
])
def test_values_helm_refuses_with_a_reason(values: dict[str, Any], refusal: str) -> None:
    """A misspelt or impossible setting stops `helm install` with what is wrong, instead of a
    deployment that ignores it or cannot work (several gateways each with its own job store)."""
    with pytest.raises(HelmError, match=re.escape(refusal)):
        helm_template(values)


def test_one_gateway_with_no_shared_job_store_and_no_tenants() -> None:
    documents = helm_template(CHART_VARIANTS["one-gateway"])
    gateway = by_kind(documents, "Deployment")["sluice-gateway"]
    assert gateway["spec"]["replicas"] == 1
    assert not by_kind(documents, "HorizontalPodAutoscaler") and not by_kind(documents, "NetworkPolicy")
    assert "sluice-gateway" not in by_kind(documents, "PodDisruptionBudget")  # it would block every node drain
    scaled_from_one = helm_template({"gateway": {"autoscaling": {"minReplicas": 1}}})
    assert "sluice-gateway" not in by_kind(scaled_from_one, "PodDisruptionBudget")  # the HPA may leave one
    (container,) = gateway["spec"]["template"]["spec"]["containers"]
    assert "--tenants" not in container["args"] and "--grpc-port" not in container["args"]
    assert container["args"][-2:] == ["--cache-mb", "512"]
    assert {"name": "SLUICE_GATEWAY_CACHE_MB", "value": "64"} in container["env"]
    assert not any(e["name"] == "SLUICE_GATEWAY_JOBS_DB" for e in container["env"])


def test_the_chart_puts_cuda_workers_on_gpus_and_mounts_a_model_repository() -> None:
    gpu = containers(helm_template(CHART_VARIANTS["gpu"]))
    assert gpu["worker"]["image"] == "sluice:0.1.0-cuda" and gpu["gateway"]["image"] == "sluice:0.1.0"
    assert gpu["worker"]["resources"]["limits"] == {"nvidia.com/gpu": 2, "memory": "8Gi"}
    worker_pod = workloads(helm_template(CHART_VARIANTS["gpu"]))["sluice-worker"]["spec"]["template"]["spec"]
    assert worker_pod["tolerations"] == [{"key": "pool", "operator": "Exists"},
                                         {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    documents = helm_template({**CHART_VARIANTS["own-redis-and-models"], "image": {"repository": "r.example/sluice",
                                                                                 "tag": "0.1.1"}})
    assert not workloads(documents).keys() - {"sluice-gateway", "sluice-worker"}  # no Redis of its own
    worker_pod = by_kind(documents, "Deployment")["sluice-worker"]["spec"]["template"]["spec"]
    models = {"name": "models", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}
    assert models in worker_pod["volumes"]
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in worker_pod["containers"][0]["volumeMounts"]
    assert worker_pod["containers"][0]["image"] == "r.example/sluice:0.1.1"


@pytest.mark.slow
def test_the_manifests_commands_make_a_working_cluster(tmp_path: Path) -> None:
    """The Redis, gateway and worker containers' args and environment, with the cluster's names
    and ports swapped for local ones: Redis requires the Secret's password and the others use it,
    a worker registers, the gateway finds it, a tenant's key is required and works, the metrics
    the autoscaler reads are where Prometheus scrapes, and what Redis holds survives its restart."""
    documents = render(KUBERNETES / "base")
    values = {"REDIS_PASSWORD": secrets.token_hex(16), "POD_NAME": "sluice-worker-0", "POD_IP": "127.0.0.1"}
    (tmp_path / "redis").mkdir()
    redis_args, _ = _arguments(containers(documents)["redis"], values)
    redis_args = [str(tmp_path / "redis") if a == "/data" else a for a in redis_args]
    redis_process, redis_port = start_redis(tmp_path / "redis", *redis_args)
    redis_address = f"127.0.0.1:{redis_port}"
    repo = write_emulated_model(tmp_path / "models", alpha_ms=2, beta_ms=0.1)
    tenants = tmp_path / "tenants.toml"
    created = subprocess.run([sys.executable, "-m", "sluice", "keys", "create", "team", "--tenants", str(tenants)],
                             capture_output=True, text=True, check=True)
    key = created.stdout.strip().split()[-1]
    gateway_port, grpc_port, worker_port, metrics_port = free_port(), free_port(), free_port(), free_port()
    local = {"sluice-redis:6379/0": f"{redis_address}/8", "/etc/sluice/tenants.toml": str(tenants),
             "/models": str(repo), "tcp://0.0.0.0:7000": f"tcp://127.0.0.1:{worker_port}",
             ":7000": f":{worker_port}", "8000": str(gateway_port), "8001": str(grpc_port),
             "9090": str(metrics_port)}

    def localized(text: str) -> str:
        for cluster, here in local.items():
            text = text.replace(cluster, here)
        return text

    processes = [redis_process]
    try:
        with pytest.raises(redis.AuthenticationError):  # no password, no entry
            redis.Redis(port=redis_port).ping()
        for name in ("worker", "gateway"):
            args, env = _arguments(containers(documents)[name], values)
            env = {k: localized(v) for k, v in env.items() if k != "SLUICE_GATEWAY_JOBS_DB"}
            processes.append(subprocess.Popen([sys.executable, "-m", "sluice", *map(localized, args)],
                                              env={**os.environ, **env}))
        url = f"http://127.0.0.1:{gateway_port}"
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{url}/v2/health/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and all(p.poll() is None for p in processes)
            time.sleep(0.2)
        body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 3], "data": [1.0, 2.0, 3.0]}]}
        assert httpx.post(f"{url}/v2/models/emulated/infer", json=body).status_code == 401
        answer = httpx.post(f"{url}/v2/models/emulated/infer", json=body, headers={"Authorization": f"Bearer {key}"})
        assert answer.status_code == 200 and answer.json()["outputs"][0]["data"] == [6.0]
        with tritonclient.grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}") as over_grpc:  # the grpc port
            rows = tritonclient.grpc.InferInput("INPUT0", [1, 3], "FP32")
            rows.set_data_from_numpy(np.array([[1.0, 2.0, 3.0]], dtype=np.float32))
            result = over_grpc.infer("emulated", [rows], headers={"authorization": f"Bearer {key}"})
            assert result.as_numpy("OUTPUT0").tolist() == [6.0]
        worker_metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
        busy = re.search(r'^sluice_device_busy_seconds_total\{worker="sluice-worker-0"\} (\S+)$', worker_metrics,
                         re.MULTILINE)
        assert busy is not None and float(busy.group(1)) > 0, worker_metrics[:2000]
        for name in ("worker", "gateway"):  # each HTTP probe's path, on the port it names, answers 200
            container = containers(documents)[name]
            ports = {port["name"]: port["containerPort"] for port in container["ports"]}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if (check := container.get(probe, {}).get("httpGet")) is not None:
                    port = localized(str(ports.get(check["port"], check["port"])))
                    answered = httpx.get(f"http://127.0.0.1:{port}{check['path']}")
                    assert answered.status_code == 200, (name, probe, answered.text)
        stop_all(processes[1:])  # the worker withdraws its registration
        client = redis.Redis(port=redis_port, password=values["REDIS_PASSWORD"], db=8)
        kept = {key: client.dump(key) for key in client.scan_iter() if client.ttl(key) == -1}
        assert any(key.startswith(b"sluice:limits:") for key in kept), kept  # the tenant's usage
        redis_process.terminate()
        redis_process.wait(timeout=10)
        redis_process, redis_port = start_redis(tmp_path / "redis", *redis_args)
        processes = [redis_process]
        client = redis.Redis(port=redis_port, password=values["REDIS_PASSWORD"], db=8)
        assert {key: client.dump(key) for key in client.scan_iter() if client.ttl(key) == -1} == kept
    finally:
        stop_all(processes)
