"""The Grafana dashboard, generated from code so its queries stay checkable.

``python -m gateway.observe.dashboard --update`` writes ``docs/grafana-dashboard.json`` and
``k8s/grafana-dashboard.yaml`` (the same JSON in a ConfigMap labelled for Grafana's dashboard
sidecar).  ``tests/core/test_k8s_kit.py`` checks both are current and that every metric a
query names is one the gateway exports.

Queries aggregate over gateway pods: per-request counters are summed (each pod counts its
own requests); per-replica engine series are exported by *every* pod for the same replica,
so they are reduced with ``max by (replica)`` before being summed or joined to routes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOC_PATH = ROOT / "docs" / "grafana-dashboard.json"
CONFIGMAP_PATH = ROOT / "k8s" / "grafana-dashboard.yaml"
UID = "prefix-gateway"

ROUTE = 'route=~"$route"'


def _engine_by_route(counter: str) -> str:
    """A scraped per-replica engine counter's rate, summed per route over the route's pool."""
    return (
        f"sum by (route) (max by (replica) (rate(prefix_gateway_engine_{counter}_total[5m]))"
        f" * on (replica) group_right max by (route, replica) (prefix_gateway_route_replica_info{{{ROUTE}}}))"
    )


# (title, unit, [(legend, expr)], width)
ROWS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]], int]]]] = [
    (
        "Prefix-cache hit rate",
        [
            (
                "Hit rate reported by replicas (usage.cached_tokens)",
                "percentunit",
                [
                    (
                        "{{route}}",
                        f"sum by (route) (rate(prefix_gateway_cached_tokens_total{{{ROUTE}}}[5m]))"
                        f" / sum by (route) (rate(prefix_gateway_cache_reported_prompt_tokens_total{{{ROUTE}}}[5m]))",
                    )
                ],
                6,
            ),
            (
                "Hit rate predicted by the gateway",
                "percentunit",
                [
                    (
                        "{{route}}",
                        f"sum by (route) (rate(prefix_gateway_predicted_cached_tokens_total{{{ROUTE}}}[5m]))"
                        f" / sum by (route) (rate(prefix_gateway_predicted_prompt_tokens_total{{{ROUTE}}}[5m]))",
                    )
                ],
                6,
            ),
            (
                "Hit rate measured by the engines (vLLM /metrics)",
                "percentunit",
                [
                    (
                        "{{route}}",
                        f"{_engine_by_route('prefix_cache_hits')} / {_engine_by_route('prefix_cache_queries')}",
                    )
                ],
                6,
            ),
            (
                "Prediction error (mean |predicted - reported| per prompt token)",
                "percentunit",
                [
                    (
                        "{{route}}",
                        f"sum by (route) (rate(prefix_gateway_prediction_error_tokens_total{{{ROUTE}}}[5m]))"
                        " / sum by (route) "
                        f"(rate(prefix_gateway_prediction_checked_prompt_tokens_total{{{ROUTE}}}[5m]))",
                    )
                ],
                6,
            ),
        ],
    ),
    (
        "Latency and traffic",
        [
            (
                "Time to first token",
                "s",
                [
                    (
                        f"p{q} {{{{route}}}}",
                        f"histogram_quantile(0.{q}, sum by (le, route) "
                        f"(rate(prefix_gateway_ttft_seconds_bucket{{{ROUTE}}}[5m])))",
                    )
                    for q in (50, 90)
                ],
                8,
            ),
            (
                "Requests by status class",
                "reqps",
                [
                    (
                        "{{route}} {{status_class}}",
                        f"sum by (route, status_class) (rate(prefix_gateway_requests_total{{{ROUTE}}}[1m]))",
                    )
                ],
                8,
            ),
            (
                "Errors by kind",
                "reqps",
                [("{{route}} {{kind}}", f"sum by (route, kind) (rate(prefix_gateway_errors_total{{{ROUTE}}}[5m]))")],
                8,
            ),
            (
                "Gateway added latency",
                "s",
                [
                    (
                        f"p{q}",
                        f"histogram_quantile(0.{q}, sum by (le) "
                        f"(rate(prefix_gateway_added_latency_seconds_bucket{{{ROUTE}}}[5m])))",
                    )
                    for q in (50, 99)
                ],
                8,
            ),
            (
                "Routing decisions by policy branch",
                "reqps",
                [
                    (
                        "{{route}} {{reason}}",
                        f"sum by (route, reason) (rate(prefix_gateway_decisions_total{{{ROUTE}}}[5m]))",
                    )
                ],
                8,
            ),
            (
                "Normalization: volatile spans moved or found",
                "ops",
                [
                    (
                        "{{route}} {{rule}} ({{mode}})",
                        f"sum by (route, rule, mode) (rate(prefix_gateway_normalize_spans_total{{{ROUTE}}}[5m]))",
                    )
                ],
                8,
            ),
        ],
    ),
    (
        "Replicas: load and balance",
        [
            (
                "In flight per replica (all gateway pods)",
                "short",
                [("{{replica}}", "sum by (replica) (prefix_gateway_replica_in_flight)")],
                8,
            ),
            (
                "Prefill work per replica (uncached prompt tokens/s, engines)",
                "short",
                [
                    (
                        "{{replica}}",
                        "max by (replica) (rate(prefix_gateway_engine_prompt_tokens_total[5m]))"
                        " - max by (replica) (rate(prefix_gateway_engine_prefix_cache_hits_total[5m]))",
                    )
                ],
                8,
            ),
            (
                "Prefill-work balance (busiest / mean replica; 1 = even)",
                "short",
                [
                    (
                        "balance",
                        "max(max by (replica) (rate(prefix_gateway_engine_prompt_tokens_total[5m]))"
                        " - max by (replica) (rate(prefix_gateway_engine_prefix_cache_hits_total[5m])))"
                        " / avg(max by (replica) (rate(prefix_gateway_engine_prompt_tokens_total[5m]))"
                        " - max by (replica) (rate(prefix_gateway_engine_prefix_cache_hits_total[5m])))",
                    )
                ],
                8,
            ),
            (
                "Queued prefill tokens per replica (sent, no first byte yet)",
                "short",
                [("{{replica}}", "sum by (replica) (prefix_gateway_replica_pending_prefill_tokens)")],
                8,
            ),
            (
                "KV-cache usage and waiting requests (engines)",
                "short",
                [
                    ("kv {{replica}}", "max by (replica) (prefix_gateway_engine_kv_cache_usage)"),
                    ("waiting {{replica}}", "max by (replica) (prefix_gateway_engine_requests_waiting)"),
                ],
                8,
            ),
            (
                "Gateway's KV cache model: share held (replica_cache_tokens; near 1 = evicting)",
                "percentunit",
                [
                    (
                        "{{route}} {{replica}}",
                        f'max by (route, replica) (prefix_gateway_kv_model_tokens{{kind="held", {ROUTE}}})'
                        f' / max by (route, replica) (prefix_gateway_kv_model_tokens{{kind="capacity", {ROUTE}}})',
                    )
                ],
                8,
            ),
        ],
    ),
    (
        "Health, membership and shared state",
        [
            (
                "Replica health (1 = takes traffic)",
                "short",
                [("{{replica}}", "min by (replica) (prefix_gateway_replica_healthy)")],
                8,
            ),
            (
                "Discovered and draining replicas",
                "short",
                [
                    ("{{source}} ({{kind}})", "max by (source, kind) (prefix_gateway_discovery_replicas)"),
                    ("draining", "sum (prefix_gateway_replicas_draining)"),
                    ("source down: {{source}}", "min by (source) (prefix_gateway_discovery_up) == 0"),
                ],
                8,
            ),
            (
                "Config reloads and health changes",
                "short",
                [
                    ("reload {{outcome}}", "sum by (outcome) (increase(prefix_gateway_config_reloads_total[5m]))"),
                    (
                        "health changes {{replica}}",
                        "max by (replica) (increase(prefix_gateway_replica_health_changes_total[5m]))",
                    ),
                ],
                8,
            ),
            (
                "Shared state (Redis)",
                "short",
                [
                    ("connected pods", "sum (prefix_gateway_state_sync_connected)"),
                    ("peers seen (max)", "max (prefix_gateway_state_sync_peers)"),
                    ("records {{outcome}}/s", "sum by (outcome) (rate(prefix_gateway_state_sync_records_total[5m]))"),
                ],
                8,
            ),
        ],
    ),
]


def build_dashboard() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model (schema 39; imports into Grafana 10+)."""
    datasource = {"type": "prometheus", "uid": "${datasource}"}
    panels: list[dict[str, Any]] = []
    y = 0
    next_id = 1
    for row_title, row_panels in ROWS:
        panels.append(
            {"type": "row", "title": row_title, "id": next_id, "collapsed": False,
             "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}}
        )  # fmt: skip
        next_id += 1
        y += 1
        x = 0
        for title, unit, targets, width in row_panels:
            if x + width > 24:
                x, y = 0, y + 8
            panels.append(
                {
                    "type": "timeseries",
                    "title": title,
                    "id": next_id,
                    "datasource": datasource,
                    "gridPos": {"h": 8, "w": width, "x": x, "y": y},
                    "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                    "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}},
                    "targets": [
                        {"refId": chr(ord("A") + i), "datasource": datasource, "expr": expr, "legendFormat": legend}
                        for i, (legend, expr) in enumerate(targets)
                    ],
                }
            )
            next_id += 1
            x += width
        y += 8
    return {
        "uid": UID,
        "title": "prefix-gateway",
        "description": "Prefix-cache-aware gateway for vLLM: hit rates, latency, replica balance, health.",
        "tags": ["prefix-gateway", "vllm"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-3h", "to": "now"},
        "timezone": "",
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
                {
                    "name": "route",
                    "type": "query",
                    "label": "Route",
                    "datasource": datasource,
                    "query": {"query": "label_values(prefix_gateway_route_info, route)", "refId": "routes"},
                    "definition": "label_values(prefix_gateway_route_info, route)",
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "current": {"text": "All", "value": "$__all"},
                    "refresh": 2,
                },
            ]
        },
        "annotations": {"list": []},
        "panels": panels,
    }


def dashboard_json() -> str:
    return json.dumps(build_dashboard(), indent=2) + "\n"


def configmap_yaml() -> str:
    """The dashboard in a ConfigMap that Grafana's sidecar (label grafana_dashboard=1) loads."""
    body = "".join(f"    {line}\n" if line else "\n" for line in dashboard_json().splitlines())
    return (
        "# Generated by `python -m gateway.observe.dashboard --update` (same JSON as docs/grafana-dashboard.json).\n"
        "# Grafana's dashboard sidecar (kube-prometheus-stack: sidecar.dashboards.enabled) loads ConfigMaps\n"
        "# labelled grafana_dashboard=1; or import docs/grafana-dashboard.json by hand.\n"
        "apiVersion: v1\n"
        "kind: ConfigMap\n"
        "metadata:\n"
        "  name: prefix-gateway-dashboard\n"
        "  labels:\n"
        "    app.kubernetes.io/name: prefix-gateway\n"
        '    grafana_dashboard: "1"\n'
        "data:\n"
        "  prefix-gateway.json: |\n" + body
    )


def expressions(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression in the dashboard (panel targets and template queries)."""
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return exprs


def update() -> list[Path]:
    changed = []
    for path, text in ((DOC_PATH, dashboard_json()), (CONFIGMAP_PATH, configmap_yaml())):
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            changed.append(path)
    return changed


if __name__ == "__main__":  # python -m gateway.observe.dashboard --update
    if sys.argv[1:] != ["--update"]:
        raise SystemExit("usage: python -m gateway.observe.dashboard --update")
    for path in update():
        print("updated", path)
