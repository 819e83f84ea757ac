"""Shared by the prefix-policy tests: a 4-replica policy and reproducible block-key chains."""

from __future__ import annotations

import random

from gateway.routing.base import ReplicaView, RequestView
from gateway.routing.policies.prefix import PrefixPolicy, PrefixPolicySettings

NAMES = ["r0", "r1", "r2", "r3"]


def policy(**kw: object) -> PrefixPolicy:
    return PrefixPolicy(PrefixPolicySettings(**kw), [ReplicaView(n) for n in NAMES])  # type: ignore[arg-type]


def chain(n: int, seed: int) -> tuple[int, ...]:
    rnd = random.Random(seed)
    return tuple(rnd.getrandbits(64) for _ in range(n))


def req(keys: tuple[int, ...], session: str | None = None, rid: str = "x") -> RequestView:
    """A chat request whose window is its keys (3 tokens past the last full block)."""
    return RequestView(rid, "route", "m", "chat", session, keys, 16, len(keys) * 16 + 3)


def views(loads: dict[str, int] | None = None) -> list[ReplicaView]:
    """The 4 replicas with these in-flight counts (0 where not given)."""
    loads = loads or {}
    return [ReplicaView(n, in_flight=loads.get(n, 0)) for n in NAMES]
