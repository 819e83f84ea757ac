"""The normalization benchmark times the paths it names: the static prompt left as it is, the
timestamp moved once detected, the unknown value once learned, and new text never stable."""

from __future__ import annotations

import random

from benchmarks import bench_normalize as bn
from gateway.prefix.normalize import Normalizer
from gateway.prefix.settings import NormalizeSettings


def _systems(name: str, n: int) -> list[str]:
    make = bn.cases(random.Random(7))[name]
    norm = Normalizer(NormalizeSettings(mode="relocate"))
    return [norm.apply("chat", make(i)).body["messages"][0]["content"] for i in range(n)]


def test_each_case_takes_the_path_its_row_is_named_for() -> None:
    static = _systems("static", 3)
    assert static[0] == static[2] == bn.cases(random.Random(7))["static"](0)["messages"][0]["content"]
    timestamp = _systems("timestamp", 4)
    assert "2025-03-04T05:00:01Z" not in timestamp[1] and timestamp[1] == timestamp[3]  # moved from the second on
    unknown = _systems("unknown_value", 6)
    assert unknown[0] != unknown[1] and unknown[4] == unknown[5]  # learned after a few requests, then moved
    new_text = _systems("new_text", 3)
    assert len({text[:200] for text in new_text}) == 3  # nothing repeats
    assert all(len(text) >= bn.CHARS for text in static + new_text)
