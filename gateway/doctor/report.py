"""Render a :class:`~gateway.doctor.analyses.Diagnosis`: text for a person, JSON for tools.

The JSON is the contract (``--json``): ``source``, ``routes`` (hit rates: reported,
predicted by the gateway, replayed as the samples are, replayed with every fix) and
``findings`` ranked best first, each with ``cause``, ``title``, ``evidence``, estimated
``gain`` and a ``fix`` (``summary``, ``yaml`` snippet, machine-readable ``patch``).
"""

from __future__ import annotations

import json
import textwrap
from typing import Any

from gateway.doctor.analyses import Diagnosis


def to_dict(diagnosis: Diagnosis) -> dict[str, Any]:
    return {
        "source": diagnosis.source,
        "routes": [route.as_dict() for route in diagnosis.routes],
        "findings": [finding.as_dict() for finding in diagnosis.findings],
        "notes": diagnosis.notes,
    }


def render_json(diagnosis: Diagnosis) -> str:
    return json.dumps(to_dict(diagnosis), indent=2, ensure_ascii=False)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.1f} %"


def _points(value: float | None) -> str:
    return "" if value is None else f"{value * 100:+.1f} pts"


def render_text(diagnosis: Diagnosis) -> str:
    lines = [f"prefix-gateway doctor: {diagnosis.source}", ""]
    for route in diagnosis.routes:
        lines.append(
            f"route {route.name} (normalize: {route.normalize}): {route.requests} requests; hit rate reported "
            f"{_pct(route.hit_rate_reported)}, predicted {_pct(route.hit_rate_predicted)}"
            + (f" (prediction error {_pct(route.prediction_error)} of prompt tokens)" if route.prediction_error else "")
            + "; replay of the samples: "
            f"{_pct(route.hit_rate_replayed)} now, {_pct(route.hit_rate_all_fixes)} with every fix below"
        )
    lines.append("")
    if not diagnosis.findings:
        analysed = sum(route.requests or 0 for route in diagnosis.routes)
        lines.append(
            f"The {analysed} requests analysed show no cause of misses."
            if analysed
            else "No request could be analysed, so no cause of misses can be named (see the notes below)."
        )
    for n, finding in enumerate(diagnosis.findings, 1):
        gain = ""
        if finding.gain is not None:
            gain = f"  [{_points(finding.gain)}"
            if finding.hit_rate_if_fixed is not None:
                gain += f" → {_pct(finding.hit_rate_if_fixed)}"
            if finding.gain_with_other_fixes is not None and abs(finding.gain_with_other_fixes - finding.gain) > 0.005:
                gain += f"; {_points(finding.gain_with_other_fixes)} with the other fixes"
            gain += "]"
        lines.append(f"{n}. [{finding.route}] {finding.title}{gain}")
        for item in finding.evidence:
            lines.extend(textwrap.wrap(item, 110, initial_indent="   - ", subsequent_indent="     "))
        lines.extend(textwrap.wrap("fix: " + finding.fix.summary, 110, initial_indent="   ", subsequent_indent="     "))
        if finding.fix.yaml:
            lines.extend("       " + row for row in finding.fix.yaml.splitlines())
        lines.append("")
    for note in diagnosis.notes:
        lines.extend(textwrap.wrap(note, 110, initial_indent="note: ", subsequent_indent="      "))
    return "\n".join(lines).rstrip() + "\n"
