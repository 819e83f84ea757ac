"""The virtual-clock benchmark's ``precise`` row: the simulated engines' KV events (the
simulator's in-process callback) feed the gateway's precise index, which then decides.

Needs the simulator's KV events (gateway/sim/kvevents.py, the ``simkv`` work): skipped without.
"""

from __future__ import annotations

import pytest

pytest.importorskip("gateway.sim.kvevents")

from benchmarks import bench_virtual as bv
from benchmarks.workloads import build

pytestmark = pytest.mark.slow


def test_the_precise_row_is_fed_by_the_engines_events_and_matches_from_them() -> None:
    wl = build("agent", size=0.1)
    rows = [row for row in bv.rows_for(wl, [], peers=False, precise=True) if row[0] in ("prefix_aligned", "precise")]
    routers = {}

    def keep(name, factory):
        def make():
            routers[name] = factory()
            return routers[name]

        return make

    cells = bv.run_level(wl, "moderate", [(name, keep(name, factory), oracle) for name, factory, oracle in rows])
    precise = routers["precise"]
    assert all(cells[name]["requests"] == len(wl.requests) for name in cells)
    assert precise.ingestor.index.blocks() > 0  # the engines' events arrived and were indexed
    assert all(feed.messages > 0 and feed.gaps == 0 for feed in precise.ingestor.feeds.values())
    assert {"precise"} == {precise.route_.runner.policy.precise.mode_of(name)[0] for name in precise.ingestor.feeds}
    # the engine's word is at least as good a prediction as the model's on the same tokens
    assert cells["precise"]["prediction_error"] <= cells["prefix_aligned"]["prediction_error"] + 0.005
