"""A vLLM replica simulator: the same HTTP API, prefix cache, timing shape, metrics and logs.

There is no GPU on the machines we test on, so every end-to-end test, the demo and every
benchmark talk to these replicas instead of vLLM.  What matters for a prefix-aware router
is modelled faithfully (block-level chained-hash prefix cache with LRU eviction and
vLLM's hit counting, continuous batching with KV-limited admission); everything else
(the model's output) is deterministic filler.

Entry points:

- :func:`gateway.sim.launcher.run_replicas` — N replica processes on free ports (tests, benchmarks)
- :func:`gateway.sim.server.serve_in_thread` — one replica inside this process (cheap unit tests)
- :func:`gateway.sim.app.create_app` — the bare ASGI app
- :func:`gateway.sim.cli.main` — ``prefix-gateway sim`` / ``python -m gateway.sim``
"""

from __future__ import annotations

DEFAULT_MODEL = "demo-model"
SIM_VERSION = "0.1.0-sim"  # what GET /version says (and system_fingerprint, as vLLM's version)

__all__ = ["DEFAULT_MODEL", "SIM_VERSION"]
