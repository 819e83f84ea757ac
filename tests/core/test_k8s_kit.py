"""The operator kit in k8s/ and docs/: consistent with itself and with what the gateway exports.

``kubernetes-validate --strict`` (tests/core/test_repo_promises.py) checks every built-in
kind; it has no schema for the Prometheus Operator's ServiceMonitor (a CRD), so that one is
checked here against the fields of its CRD that the kit uses.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from gateway.config import parse_config
from gateway.observe import dashboard
from gateway.service import Gateway

ROOT = Path(__file__).resolve().parents[2]
PROMQL_WORDS = {
    "sum", "max", "min", "avg", "by", "on", "group_right", "group_left", "rate", "increase",
    "histogram_quantile", "label_values",
    # label names the queries group or join by
    "route", "replica", "le", "status_class", "kind", "reason", "rule", "mode", "source", "outcome",
}  # fmt: skip


def manifests(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((ROOT / "k8s" / name).read_text()) if doc]


def one(name: str, kind: str) -> dict[str, Any]:
    (doc,) = [d for d in manifests(name) if d["kind"] == kind]
    return doc


def gateway_config_in_configmap() -> Any:
    data = one("configmap.yaml", "ConfigMap")["data"]["gateway.yaml"]
    return parse_config(yaml.safe_load(data), "k8s/configmap.yaml")


def exported_metric_names() -> set[str]:
    """Every series name a gateway can export (shared state and discovery on, so all collectors exist)."""
    config = parse_config(
        {
            "state": {"backend": "redis"},
            "replicas": [{"name": "r0", "url": "http://127.0.0.1:9"}],
            "discovery": [{"name": "d", "dns": {"host": "localhost"}}],
        }
    )
    gateway = Gateway(config)
    names = set()
    for family in gateway.metrics.registry.collect():
        if family.type == "counter":
            names |= {family.name + "_total", family.name + "_created"}
        elif family.type == "histogram":
            names |= {family.name + suffix for suffix in ("_bucket", "_sum", "_count", "_created")}
        else:
            names.add(family.name)
    return names


def test_the_dashboard_files_are_current() -> None:
    assert json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text()) == dashboard.build_dashboard(), (
        "run `python -m gateway.observe.dashboard --update`"
    )
    configmap = one("grafana-dashboard.yaml", "ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["prefix-gateway.json"]) == dashboard.build_dashboard()


def test_the_dashboard_queries_only_metrics_the_gateway_exports() -> None:
    exported = exported_metric_names()
    board = dashboard.build_dashboard()
    exprs = dashboard.expressions(board)
    used: set[str] = set()
    for expr in exprs:
        assert "vllm:" not in expr  # engine numbers come through the gateway's scrape
        bare = re.sub(r'"[^"]*"', "", expr)  # label values
        bare = re.sub(r"\{[^}]*\}", "", bare)  # label matchers
        bare = re.sub(r"\[[^\]]*\]", "", bare)  # range selectors
        for word in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", bare):
            if word in PROMQL_WORDS:
                continue
            assert word in exported, f"{word!r} in {expr!r} is not a metric the gateway exports"
            used.add(word)
    # the panels the issue asks for are there
    for needed in (
        "prefix_gateway_cached_tokens_total",  # hit rate reported
        "prefix_gateway_predicted_cached_tokens_total",  # predicted
        "prefix_gateway_engine_prefix_cache_hits_total",  # from the engines
        "prefix_gateway_ttft_seconds_bucket",
        "prefix_gateway_replica_in_flight",
        "prefix_gateway_engine_prompt_tokens_total",  # prefill-work balance
        "prefix_gateway_normalize_spans_total",
        "prefix_gateway_replica_healthy",
        "prefix_gateway_errors_total",
    ):
        assert needed in used
    titles = [p["title"] for p in board["panels"]]
    assert len(titles) == len(set(titles))


SERVICE_MONITOR_SCHEMA = {  # the fields of monitoring.coreos.com/v1 ServiceMonitor the kit uses
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": {"type": "string"}, "labels": {"type": "object"}},
        },
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}},
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {"type": "string", "pattern": "^([0-9]+(ms|s|m|h))+$"},
                        },
                    },
                },
            },
        },
    },
}


def test_the_service_monitor_scrapes_the_gateway_service() -> None:
    monitor = one("servicemonitor.yaml", "ServiceMonitor")
    jsonschema.validate(monitor, SERVICE_MONITOR_SCHEMA)
    service = one("service.yaml", "Service")
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    port_names = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in port_names and endpoint["path"] == "/metrics"


def test_the_vllm_example_is_what_the_gateway_discovers() -> None:
    deployment, service = one("vllm.yaml", "Deployment"), one("vllm.yaml", "Service")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert "--enable-prompt-tokens-details" in container["args"]
    assert "--enable-prefix-caching" in container["args"]
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= container.keys()
    assert service["spec"]["clusterIP"] == "None"  # headless: DNS discovery sees the pods
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    (source,) = gateway_config_in_configmap().discovery
    assert source.kubernetes is not None
    assert source.kubernetes.label_selector == f"kubernetes.io/service-name={service['metadata']['name']}"
    assert source.kubernetes.port_name in {p["name"] for p in service["spec"]["ports"]}


def test_the_gateway_may_watch_endpointslices_and_nothing_more() -> None:
    pod = one("deployment.yaml", "Deployment")["spec"]["template"]["spec"]
    account = one("rbac.yaml", "ServiceAccount")["metadata"]["name"]
    assert pod["serviceAccountName"] == account and pod["automountServiceAccountToken"] is True
    (rule,) = one("rbac.yaml", "Role")["rules"]
    assert rule == {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]}
    binding = one("rbac.yaml", "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    assert binding["roleRef"]["name"] == one("rbac.yaml", "Role")["metadata"]["name"]


def test_the_termination_grace_covers_the_drain() -> None:
    pod = one("deployment.yaml", "Deployment")["spec"]["template"]["spec"]
    server = gateway_config_in_configmap().server
    (container,) = pod["containers"]
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    budget = pre_stop + server.drain_grace_s + server.timeout_graceful_shutdown_s
    assert pod["terminationGracePeriodSeconds"] > budget


def test_the_hpa_scales_the_gateway() -> None:
    hpa = one("hpa.yaml", "HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", one("deployment.yaml", "Deployment")["metadata"]["name"])
    assert hpa["spec"]["minReplicas"] >= 2  # shared state and drain assume more than one pod
