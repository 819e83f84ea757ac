"""Gateway configs for tests: fast health checks and scrapes, no summary loop."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.config import GatewayConfig, parse_config


def gateway_config(urls: Sequence[str], **overrides: Any) -> GatewayConfig:
    """A test config over ``urls`` (replicas r0..rN): fast health checks, no summary loop."""
    data: dict[str, Any] = {
        "server": {"port": 0},
        "health": {"interval_s": 0.2, "timeout_s": 1.0, "unhealthy_threshold": 1, "eject_s": 0.5},
        "scrape": {"interval_s": 0.2},
        "logging": {"summary_interval_s": 0},
        "replicas": [{"name": f"r{i}", "url": url} for i, url in enumerate(urls)],
        "routes": [{"name": "main", "policy": "least_loaded"}],
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return parse_config(data, "<test>")
