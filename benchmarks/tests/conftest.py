"""The benchmarks' own tests (``pytest benchmarks/tests``, with the ``[bench]`` extra).

The benchmark modules import each other as ``benchmarks.*`` (a namespace package at the
repository root): make that work however pytest was started.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# The session's Redis fixtures, shared with tests/ (a real redis-server, started when none answers).
from tests.conftest import redis_session, redis_url  # noqa: E402, F401
