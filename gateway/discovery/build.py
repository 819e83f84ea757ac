"""Build the configured discovery sources (phase two for ``discovery:``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gateway.discovery.dns import DnsSource
from gateway.discovery.inference_pool import InferencePoolSource
from gateway.discovery.kubernetes import KubernetesSource
from gateway.discovery.settings import DiscoveryConfig
from gateway.discovery.stats import SourceStats


def build_sources(
    configs: Sequence[DiscoveryConfig], stats: Mapping[str, SourceStats], environ: Mapping[str, str]
) -> dict[str, Any]:
    """``name -> source`` (each has ``async run(publish)``), sharing ``stats`` with metrics."""
    sources: dict[str, Any] = {}
    for config in configs:
        if config.dns is not None:
            sources[config.name] = DnsSource(config.name, config.dns, stats[config.name])
        elif config.kubernetes is not None:
            sources[config.name] = KubernetesSource(config.name, config.kubernetes, stats[config.name], environ)
        elif config.inference_pool is not None:
            sources[config.name] = InferencePoolSource(config.name, config.inference_pool, stats[config.name], environ)
    return sources
