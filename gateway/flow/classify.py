"""A request's priority and flow, from its headers, its API key and its route (pure).

Priority: the objective a header names (``x-llm-d-inference-objective``, legacy
``x-gateway-inference-objective``) mapped through ``flow_control.objectives``; else the
API key's default (``api_key_priorities``); else the route's ``default_priority``; else 0.
An objective the config does not know falls through to the next source: a typo in a
client must not make its traffic sheddable, nor jump the queue.

Flow (the fairness id): the fairness header's value; else the API key (its sha256 hex,
never the key itself); else the route's name — every anonymous client of a route is one flow.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gateway.flow.settings import FlowControlSettings

#: a fairness header longer than this is cut (it is a dict key and, for the busiest, a metric label)
MAX_FLOW_ID = 128


@dataclass(frozen=True, slots=True)
class Classified:
    priority: int
    flow: str
    objective: str | None  # the objective named and known, if any


def classify(
    settings: FlowControlSettings,
    headers: Mapping[str, str],
    route: str,
    route_default: int | None = None,
    key_hash: str | None = None,
) -> Classified:
    """``headers`` have lower-case names; ``key_hash``: the matched client key's sha256 hex."""
    priority: int | None = None
    objective = None
    for name in settings.objective_headers:
        value = headers.get(name)
        if value:
            found = settings.objectives.get(value.strip())
            if found is not None:
                priority, objective = found, value.strip()
                break
    if priority is None and key_hash is not None:
        priority = settings.api_key_priorities.get(key_hash)
    if priority is None:
        priority = route_default if route_default is not None else 0
    flow = named_flow(settings, headers, key_hash) or "route:" + route
    return Classified(priority, flow, objective)


def named_flow(settings: FlowControlSettings, headers: Mapping[str, str], key_hash: str | None = None) -> str | None:
    """The flow a client named: its fairness header's value, else its API key; None for an
    anonymous request (its route's one flow).  Routing reads it too (a shared head is not
    copied to spread one flow's burst, see ``gateway.routing.policies.prefix``), whether or not
    flow control is on."""
    for name in settings.fairness_headers:
        value = headers.get(name)
        if value and value.strip():
            return "id:" + value.strip()[:MAX_FLOW_ID]
    return "key:" + key_hash[:16] if key_hash else None


def vllm_priority(priority: int) -> str:
    """``X-Vllm-Priority`` for a gateway priority: vLLM schedules the lowest value first."""
    return str(-priority)
