"""The queue's memory under 10,000 queued requests stays within its bound (tracemalloc, in process)."""

from __future__ import annotations

import gc
import tracemalloc

import pytest

from gateway.flow.queue import ENTRY_BYTES, FlowQueue, QueueFull
from gateway.flow.settings import FlowControlSettings

N = 10_000


@pytest.mark.parametrize("flows", [1, 100, N])
def test_ten_thousand_queued_requests_stay_within_the_bound(flows: int) -> None:
    settings = FlowControlSettings(max_requests_per_band=N, max_bytes_per_band=N * 4096)
    names = [f"tenant-{i}" for i in range(flows)]
    queue = FlowQueue(settings.band)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        entries = [queue.push(names[i % flows], 0, 100 + i % 50, 4096, now=i * 1e-4) for i in range(N)]
        held = tracemalloc.get_traced_memory()[0] - base - entries.__sizeof__()
        # the bound holds: one more is refused, in requests and (another band) in bytes
        with pytest.raises(QueueFull):
            queue.push("one-more", 0, 1, 1, now=1.0)
        assert held <= N * ENTRY_BYTES, f"{held / N:.0f} bytes per queued request"
        for entry in entries[::2]:  # clients leaving from the middle
            queue.remove(entry)
        while queue.pop() is not None:
            pass
        del entries
        gc.collect()
        left = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert len(queue) == 0
    assert left < 64 * 1024, f"{left} bytes left behind by an empty queue"


def test_the_byte_bound_refuses_before_the_request_bound() -> None:
    queue = FlowQueue(FlowControlSettings(max_requests_per_band=N, max_bytes_per_band=10 * 1024).band)
    for _ in range(10):
        queue.push("f", 0, 1, 1024, now=0.0)
    with pytest.raises(QueueFull) as full:
        queue.push("f", 0, 1, 1, now=0.0)
    assert full.value.what == "bytes" and len(queue) == 10
