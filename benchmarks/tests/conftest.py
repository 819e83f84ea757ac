"""The benchmark modules import each other as ``benchmarks.*`` (a namespace package at the
repository root); make that work however pytest was started."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
