"""The body-memory benchmark measures what its table says: each body takes the path its row is
named for (the dated prompt is relocated, the others go upstream as the client's bytes), the
bodies fit the cap they stand for, held counts the request's own objects and nothing the
gateway keeps after it (retained) nor ``asyncio.run``'s repr of them (peak), the in-flight count
it waits for is the gateway's own metric, and a quick run writes the fields docs/sizing.md reads.

Sizes are small (256 KiB bodies): the ratios per body byte are what is checked, not timings.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import generate_latest

from benchmarks import bench_body_memory as bb
from gateway.config import load_config, packaged_default_config
from gateway.proxy.parse import parse_body
from gateway.service import Gateway

SMALL = 256 * 1024


def _gateway() -> Gateway:
    gateway = Gateway(load_config(packaged_default_config()))
    gateway._warm_pipelines()
    return gateway


def test_each_body_takes_the_path_its_row_is_named_for() -> None:
    gateway = _gateway()
    bb.teach(gateway)
    rows = {name: bb.measure(gateway, endpoint, raw) for name, (endpoint, raw) in bb.bodies(SMALL).items()}
    assert bb.DATED in rows
    for name, row in rows.items():
        dated = name == bb.DATED
        assert row["relocated"] is dated, f"{name}: relocated {row['relocated']}"
        assert row["rewritten"] is dated, f"{name}: a copy went upstream: {row['rewritten']}"
    # the plan's rewritten body and its serialization upstream are held too: two bodies more
    plain = rows["chat, one long ASCII message"]
    assert rows[bb.DATED]["held_per_body_byte"] > plain["held_per_body_byte"] + 1.5


def test_the_dated_prompt_is_relocated_only_once_the_gateway_saw_it_change() -> None:
    endpoint, raw = bb.bodies(SMALL)[bb.DATED]
    untaught = _gateway()
    assert untaught.plan(endpoint, parse_body(raw, endpoint), {}, "t").body is None  # a template's first sight
    gateway = _gateway()
    bb.teach(gateway)
    body = gateway.plan(endpoint, parse_body(raw, endpoint), {}, "t").body
    assert body is not None, "teach() did not make the dated prompt take the relocation path"
    system = body["messages"][0]["content"]
    assert "2026-12-01" not in system and "{{volatile:" in system
    assert "2026-12-01" in body["messages"][-1]["content"]  # the values block, at the end


def test_the_bodies_fit_the_cap_they_stand_for() -> None:
    limit = load_config(packaged_default_config()).server.max_body_bytes
    made = bb.bodies(limit)
    assert len(made) == 5
    for name, (endpoint, raw) in made.items():
        assert 0.7 * limit < len(raw) <= limit, f"{name}: {len(raw)} bytes"  # read_body would refuse more
        assert endpoint == ("completions" if name.startswith("completions") else "chat"), name
    raw = made["chat, CJK text (UTF-8, not escaped)"][1]
    assert b"\\u" not in raw and "漢字".encode() in raw
    assert made["completions, token ids"][1].startswith(b'{"model": "demo-model", "prompt": [10000, 10001, ')
    assert made["chat, many short messages"][1].count(b'"role"') == limit // 60


class _StubGateway:
    """Just what ``measure`` calls: ``plan`` keeps ``keep`` bytes of its own (an index entry that
    outlives the request) and, with ``rewrite``, returns a rewritten body (a relocation)."""

    def __init__(self, keep: int, rewrite: bool = False) -> None:
        server, upstream = SimpleNamespace(max_body_bytes=2**30), SimpleNamespace(stream_usage=False)
        self.config = SimpleNamespace(server=server, upstream=upstream)
        self.index: list[bytes] = []
        self.keep, self.rewrite = keep, rewrite

    def plan(self, endpoint: str, body: dict[str, Any], headers: Any, request_id: str) -> Any:
        self.index.append(b"k" * self.keep)
        rewritten = {**body, "messages": [{"role": "user", "content": "x" * self.keep}]} if self.rewrite else None
        return SimpleNamespace(body=rewritten, request=SimpleNamespace(stream=False), endpoint=endpoint)


def test_held_retained_and_peak_on_a_hand_checkable_body() -> None:
    n = 100_000
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "漢" * n}]}, ensure_ascii=False).encode()
    stub = _StubGateway(keep=len(raw))
    row = bb.measure(stub, "chat", raw)  # type: ignore[arg-type]
    # held: the joined bytes (3n) and the parsed text (2 bytes a character: 2n) = 5n; nothing else
    assert row["held_bytes"] == pytest.approx(5 * n, rel=0.01)
    assert row["retained_bytes"] == pytest.approx(len(raw), rel=0.01)  # the stub's index entry, not held
    assert (row["rewritten"], row["relocated"]) == (False, False)
    # the peak: the joined bytes (1x) and CPython's UTF-8 decode of them (3x before it shrinks)
    # = 4x; a repr of the joined bytes (4 characters a byte) on asyncio.run's way out: 6.7x
    assert row["held_bytes"] + row["retained_bytes"] <= row["peak_bytes"] < 5 * len(raw)

    row = bb.measure(_StubGateway(keep=n, rewrite=True), "chat", raw)  # type: ignore[arg-type]
    assert (row["rewritten"], row["relocated"]) == (True, True)
    # plus the plan's rewritten body (n) and its serialization upstream (~n)
    assert row["held_bytes"] == pytest.approx(7 * n, rel=0.02)


def test_the_in_flight_count_it_waits_for_is_the_gateways_metric() -> None:
    gateway = Gateway(load_config(packaged_default_config()))
    slots = [gateway.capacity.enter(100) for _ in range(3)]
    text = generate_latest(gateway.metrics.registry).decode()
    assert bb._in_flight(text) == 3  # a renamed metric would read 0 and the wait would time out
    for slot in slots:
        slot.release()
    assert bb._in_flight(generate_latest(gateway.metrics.registry).decode()) == 0


def test_a_quick_run_writes_its_table_and_json(tmp_path: Path, monkeypatch, capsys) -> None:
    out = tmp_path / "body.json"
    monkeypatch.setattr(bb, "RESULTS", out)
    assert bb.main(["--mib", "0.25", "--in-flight", "0"]) == 0
    result = json.loads(out.read_text())
    assert set(result["bodies"]) == set(bb.bodies(1024))
    fields = {"body_bytes", "peak_per_body_byte", "held_per_body_byte", "retained_per_body_byte", "rewritten"}
    for name, row in result["bodies"].items():
        assert fields <= set(row), name
        assert 1 <= row["held_per_body_byte"] <= row["peak_per_body_byte"], name
    assert result["bodies"][bb.DATED]["relocated"] is True  # main taught the gateway first
    assert result["in_flight"] is None and result["machine"]["python"]
    table = capsys.readouterr().out
    assert "peak x" in table and "held x" in table
    assert all(name in table for name in result["bodies"])


@pytest.mark.slow
def test_the_in_flight_row_measures_while_every_request_is_held() -> None:
    row = bb.in_flight_overhead(4, latency_s=1.0)
    assert row["in_flight_seen"] == 4 and row["answered_200"] == 4
    assert row["rss_before_mib"] > 0 and row["rss_in_flight_mib"] > 0
