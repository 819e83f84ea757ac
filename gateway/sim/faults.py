"""Fault injection: what the reliability tests need a replica to do wrong, on demand.

Faults are set by CLI flag at start and changed at run time through ``POST /sim/faults``
(only with ``--enable-admin``).  Durations here are *real* milliseconds, not scaled by
``--time-scale``: they model the network and the process, not the GPU.
"""

from __future__ import annotations

import random
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

FAULT_FIELDS = ("error_rate", "error_status", "extra_latency_ms", "stall_after_chunks", "drop_after_chunks")


class FaultSettings(BaseModel):
    """One consistent set of faults.  Omitted fields in an update keep their value."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    error_rate: float = Field(0.0, ge=0.0, le=1.0, description="fraction of inference requests failed")
    error_status: int = Field(503, ge=400, le=599, description="HTTP status of injected failures")
    extra_latency_ms: float = Field(0.0, ge=0.0, description="added before each inference request")
    stall_after_chunks: int | None = Field(None, ge=0, description="streams stop sending after K chunks")
    drop_after_chunks: int | None = Field(None, ge=0, description="streams lose the connection after K chunks")

    @property
    def active(self) -> bool:
        return bool(
            self.error_rate
            or self.extra_latency_ms
            or self.stall_after_chunks is not None
            or self.drop_after_chunks is not None
        )


class FaultState:
    """The live faults of one replica, plus the 'restarting' window of ``POST /sim/restart``."""

    def __init__(self, settings: FaultSettings, seed: int) -> None:
        self.settings = settings
        # A private RNG: injected failures are reproducible for a given --seed and do not
        # disturb any other randomness in the process.
        self._rng = random.Random(seed ^ 0x5EED_FA17)
        self._down_until = 0.0

    def update(self, patch: dict[str, Any]) -> FaultSettings:
        """Apply a partial update (``reset: true`` first restores the defaults and ends a
        restart's downtime, so tests need not wait it out); validates fully."""
        patch = dict(patch)
        reset = bool(patch.pop("reset", False))
        base: dict[str, Any] = {} if reset else self.settings.model_dump()
        base.update(patch)
        self.settings = FaultSettings.model_validate(base)
        if reset:
            self._down_until = 0.0
        return self.settings

    def should_fail(self) -> bool:
        rate = self.settings.error_rate
        return rate > 0.0 and (rate >= 1.0 or self._rng.random() < rate)

    def go_down(self, seconds: float) -> None:
        self._down_until = max(self._down_until, time.monotonic() + seconds)

    @property
    def down(self) -> bool:
        return self._down_until > 0.0 and time.monotonic() < self._down_until
