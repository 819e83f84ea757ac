"""The doctor's word on replica discovery (``/admin/stats``'s ``membership.sources``).

A source whose API calls fail keeps its last answer, so the gateway serves on — but from a pool
that no longer follows the cluster (or an empty one, when it never answered).  A forbidden call
(RBAC), a missing CRD or an InferencePool without selector or ports says exactly what to fix;
doctor puts it first, as one finding per failing source.
"""

from __future__ import annotations

from typing import Any

from gateway.doctor.model import Finding, Fix

SEVERITY = 0.95  # above every estimated hit-rate gain but a total one: the pool itself is wrong


def discovery_failing(stats: dict[str, Any] | None) -> list[Finding]:
    """One finding per discovery source whose last call failed."""
    membership = (stats or {}).get("membership")
    sources = membership.get("sources") if isinstance(membership, dict) else None
    if not isinstance(sources, dict):
        return []
    out = []
    for name, row in sorted(sources.items()):
        if not isinstance(row, dict) or not row.get("failing"):
            continue
        failing = str(row["failing"])
        members = row.get("members") if isinstance(row.get("members"), list) else []
        if "forbidden" in failing:
            fix = (
                "grant the gateway's service account the verbs and resources named above in its Role "
                "(k8s/rbac.yaml, k8s/epp-rbac.yaml), in the namespace it watches"
            )
        elif "not found" in failing or "CRD" in failing:
            fix = "install the Gateway API Inference Extension CRDs (v1) or fix the source's name and namespace"
        else:
            fix = "fix what the error names; until then the source keeps its last answer"
        out.append(
            Finding(
                "discovery_failing",
                f"discovery {name}",
                f"discovery source {name} ({row.get('kind')}) fails: its pool does not follow the cluster",
                [failing, f"{len(members)} replica(s) kept from its last answer: " + (", ".join(members) or "none")],
                Fix(summary=fix),
                severity=SEVERITY,
                data={"source": name, "kind": row.get("kind"), "failing": failing, "errors": row.get("errors")},
            )
        )
    return out
