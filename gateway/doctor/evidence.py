"""How findings word their evidence and fixes, shared by every family of analysis.

A percentage as the report prints it, a route's config change as the YAML an operator pastes,
and the hit rate the samples' own usage reports: one wording everywhere in the report.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml

from gateway.doctor.model import Sample


def reported_rate(samples: Sequence[Sample]) -> float | None:
    """The share of prompt tokens the samples' usage says were cached (None: no usage known)."""
    known = [s for s in samples if s.cached_tokens is not None and s.prompt_tokens]
    prompt = sum(s.prompt_tokens for s in known)
    return sum(s.cached_tokens or 0 for s in known) / prompt if prompt else None


def route_yaml(route: str, section: dict[str, Any]) -> str:
    """``section`` as the route's entry of ``gateway.yaml`` (a fix's snippet)."""
    return yaml.safe_dump({"routes": [{"name": route, **section}]}, sort_keys=False, allow_unicode=True).rstrip()


def pct(value: float) -> str:
    return f"{value * 100:.1f} %"
