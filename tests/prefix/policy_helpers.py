"""Shared by the prefix-policy tests: a 4-replica policy and reproducible block-key chains."""

from __future__ import annotations

import random

from gateway.routing.base import ReplicaView
from gateway.routing.policies.prefix import PrefixPolicy, PrefixPolicySettings

NAMES = ["r0", "r1", "r2", "r3"]


def policy(**kw: object) -> PrefixPolicy:
    return PrefixPolicy(PrefixPolicySettings(**kw), [ReplicaView(n) for n in NAMES])  # type: ignore[arg-type]


def chain(n: int, seed: int) -> tuple[int, ...]:
    rnd = random.Random(seed)
    return tuple(rnd.getrandbits(64) for _ in range(n))
