"""Flow control: hold requests while a route is saturated, dispatch them by priority and
fairness, and place each one when it is dispatched (late binding).

The decision logic (:mod:`.saturation`, :mod:`.queue`, :mod:`.dispatch`, :mod:`.classify`)
is pure and clock-injected — callers pass ``now`` — so the proxy drives it in real time and
``benchmarks/bench_virtual.py`` in simulated seconds.  See ``docs/flow-control.md``.
"""
