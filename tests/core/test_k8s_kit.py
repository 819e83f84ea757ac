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


# -- the endpoint picker's kit: epp.yaml, epp-rbac.yaml, epp-configmap.yaml, inferencepool.yaml --
CRDS = ROOT / "tests" / "fixtures" / "crds"  # the upstream CRDs' schemas (README.md there: source, commit)


def strict(schema: Any) -> Any:
    """``schema`` with unknown fields refused (as ``kubernetes-validate --strict`` does for built-ins)."""
    if isinstance(schema, dict):
        out = {key: strict(value) for key, value in schema.items()}
        open_ended = "additionalProperties" in schema or schema.get("x-kubernetes-preserve-unknown-fields")
        if "properties" in schema and not open_ended:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    return schema


def crd_schema(name: str) -> dict[str, Any]:
    return strict(json.loads((CRDS / name).read_text()))


def epp_config() -> Any:
    data = one("epp-configmap.yaml", "ConfigMap")["data"]["gateway.yaml"]
    return parse_config(yaml.safe_load(data), "k8s/epp-configmap.yaml")


def test_the_pool_and_the_route_match_their_crds() -> None:
    pool, route = one("inferencepool.yaml", "InferencePool"), one("inferencepool.yaml", "HTTPRoute")
    jsonschema.validate(pool, crd_schema("inferencepool-v1.schema.json"))
    jsonschema.validate(route, crd_schema("httproute-v1.schema.json"))
    assert (pool["apiVersion"], route["apiVersion"]) == (
        "inference.networking.k8s.io/v1",
        "gateway.networking.k8s.io/v1",
    )
    # the CRDs' CEL rules that jsonschema cannot evaluate
    numbers = [p["number"] for p in pool["spec"]["targetPorts"]]
    assert len(numbers) == len(set(numbers)), "port number must be unique"
    ref = pool["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") != "Service" or "port" in ref, "port is required when kind is 'Service'"
    # a misspelt field is refused (the strict schema works)
    typo = json.loads(json.dumps(pool))
    typo["spec"]["targetPort"] = typo["spec"].pop("targetPorts")
    try:
        jsonschema.validate(typo, crd_schema("inferencepool-v1.schema.json"))
    except jsonschema.ValidationError:
        pass
    else:
        raise AssertionError("a pool with spec.targetPort (no s) passed the schema")


def test_the_pool_selects_the_vllm_pods_and_points_at_the_picker() -> None:
    pool, route = one("inferencepool.yaml", "InferencePool"), one("inferencepool.yaml", "HTTPRoute")
    vllm = one("vllm.yaml", "Deployment")["spec"]["template"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= vllm["metadata"]["labels"].items()
    (container,) = vllm["spec"]["containers"]
    served = {p["containerPort"] for p in container["ports"] if p["name"] == "http"}
    assert {p["number"] for p in pool["spec"]["targetPorts"]} == served
    assert f"--port={served.pop()}" in container["args"]
    service = one("epp.yaml", "Service")
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["name"] == service["metadata"]["name"] and ref["kind"] == "Service"
    (grpc,) = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
    assert ref["port"]["number"] == grpc["port"] and grpc["appProtocol"] in ("http2", "kubernetes.io/h2c")
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert backend == {
        "group": "inference.networking.k8s.io",
        "kind": "InferencePool",
        "name": pool["metadata"]["name"],
    }
    assert route["spec"]["parentRefs"][0]["kind"] == "Gateway"


def test_the_picker_watches_the_pool_with_the_same_routes_as_the_proxy() -> None:
    config = epp_config()
    (source,) = config.discovery
    assert source.inference_pool is not None and source.kind == "inference_pool"
    assert source.inference_pool.name == one("inferencepool.yaml", "InferencePool")["metadata"]["name"]
    assert source.inference_pool.namespace is None  # the pod's own: the pool and the picker live together
    proxy = gateway_config_in_configmap()
    assert [r.model_dump() for r in config.routes] == [r.model_dump() for r in proxy.routes]


def test_the_picker_deployment_serves_what_its_service_and_probes_use() -> None:
    deployment, service = one("epp.yaml", "Deployment"), one("epp.yaml", "Service")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert args[0] == "epp"
    flags = dict(zip(args[1::2], args[2::2], strict=True))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (int(flags["--port"]), int(flags["--metrics-port"])) == (ports["grpc"], ports["metrics"]) == (9002, 9090)
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports)
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert container["readinessProbe"]["grpc"] == {"port": 9002, "service": "readiness"}
    assert container["livenessProbe"]["grpc"] == {"port": 9002, "service": "liveness"}
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(ports["metrics"])
    # the config it reads is the picker's ConfigMap, mounted where --config points
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "config"]
    assert flags["--config"].startswith(mount["mountPath"] + "/")
    (volume,) = [v for v in pod["volumes"] if v["name"] == "config"]
    assert volume["configMap"]["name"] == one("epp-configmap.yaml", "ConfigMap")["metadata"]["name"]
    # hardened like the proxy's pods, and its grace covers the drain
    proxy_pod = one("deployment.yaml", "Deployment")["spec"]["template"]["spec"]
    (proxy_container,) = proxy_pod["containers"]
    assert pod["securityContext"] == proxy_pod["securityContext"]
    assert container["securityContext"] == proxy_container["securityContext"]
    assert container["resources"] == proxy_container["resources"]
    server = epp_config().server
    budget = container["lifecycle"]["preStop"]["sleep"]["seconds"] + server.drain_grace_s
    assert pod["terminationGracePeriodSeconds"] > budget + server.timeout_graceful_shutdown_s


def test_the_picker_may_read_its_pool_and_pods_and_nothing_more() -> None:
    pod = one("epp.yaml", "Deployment")["spec"]["template"]["spec"]
    account = one("epp-rbac.yaml", "ServiceAccount")["metadata"]["name"]
    assert pod["serviceAccountName"] == account and pod["automountServiceAccountToken"] is True
    role = one("epp-rbac.yaml", "Role")
    assert role["rules"] == [
        {
            "apiGroups": ["inference.networking.k8s.io"],
            "resources": ["inferencepools"],
            "verbs": ["get", "list", "watch"],
        },
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    ]
    binding = one("epp-rbac.yaml", "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]


def test_the_image_carries_the_picker() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'pip install --no-cache-dir "./[epp]"' in dockerfile  # gRPC + Envoy's protos: `epp` runs
    assert "9002" in dockerfile and "9090" in dockerfile
