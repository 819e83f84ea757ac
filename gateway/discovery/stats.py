"""Per-source discovery counters, read by metrics and ``/admin/stats`` (no hot-path cost)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SourceStats:
    kind: str
    replicas: int = 0  # replicas this source reports right now
    updates: int = 0  # answers received (lookups, lists, watch events)
    errors: int = 0  # failed lookups / API calls
    added: int = 0
    removed: int = 0
    failing: str | None = None  # the current error streak's message, if any
    members: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "replicas": self.replicas,
            "members": list(self.members),
            "updates": self.updates,
            "errors": self.errors,
            "added": self.added,
            "removed": self.removed,
            "failing": self.failing,
        }
