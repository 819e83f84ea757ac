"""`prefix-gateway doctor` end to end: planted causes in real traffic through a gateway and simulated
replicas (OpenAI SDK), diagnosed from the running gateway and from a JSONL file of the same requests;
then the suggested fix is applied and the traffic replayed on empty replicas, whose reported hit rate
must land within 5 points of doctor's prediction."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from doctor_helpers import (
    ADMIN_KEY,
    apply_patch,
    finding,
    gateway,
    planted_traffic,
    route,
    send,
    write_config,
    write_jsonl,
)

from gateway.cli import main
from gateway.sim.launcher import ReplicaGroup

TOLERANCE = 0.05
ROOT = Path(__file__).resolve().parents[2]


def doctor(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    capsys.readouterr()
    assert main(["doctor", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def assert_names_the_planted_causes(report: dict[str, Any]) -> dict[str, Any]:
    """The four planted causes, each with its evidence and fix; returns the volatile-span finding."""
    volatile = finding(report, "volatile_span")
    places = {(s["where"], s["rule"]) for s in volatile["data"]["spans"]}
    assert ("messages[0].content", "iso_datetime") in places  # the leading timestamp
    assert ("tools[0].function.description", "uuid") in places  # the per-request UUID in a tool
    assert volatile["fix"]["patch"] == {"route": "main", "normalize": {"mode": "relocate"}}
    assert "mode: relocate" in volatile["fix"]["yaml"]
    assert volatile["gain"] > 0.5  # relocating is worth most of the cache
    short = finding(report, "short_prompt")
    assert short["data"]["requests"] == 5 and "block" in short["title"]
    salt = finding(report, "tenant_salt")
    assert salt["data"]["salts"] == 2 and salt["gain_with_other_fixes"] > 0
    assert "cache_salt" in salt["fix"]["summary"]
    assert report["findings"][0]["cause"] == "volatile_span"  # ranked first: it costs the most
    return volatile


def replayed_rate(urls: list[str], patch: dict[str, Any], bodies: list[dict[str, Any]]) -> float:
    """The replicas' reported hit rate for ``bodies`` sent through a gateway with ``patch`` applied."""
    with gateway(urls, [apply_patch(route("report"), patch)]) as gw:
        prompt, cached = send(gw, bodies)
    return cached / prompt


@pytest.mark.slow
def test_doctor_on_a_running_gateway_names_the_causes_and_predicts_the_fix(
    fleet: ReplicaGroup, fresh_fleet: ReplicaGroup, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFIX_GATEWAY_ADMIN_KEY", ADMIN_KEY)
    bodies = planted_traffic(30)
    with gateway(fleet.urls, [route("report")], samples={"enabled": True}) as gw:
        prompt, cached = send(gw, bodies)
        report = doctor(capsys, "--gateway", gw.url)
        # the text report, from the installed command's own process
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        run = subprocess.run(
            [sys.executable, "-m", "gateway", "doctor", "--gateway", gw.url],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert run.returncode == 0, run.stderr
        text = run.stdout
    assert cached / prompt < 0.05  # the planted causes really ruin the cache
    volatile = assert_names_the_planted_causes(report)
    summary = report["routes"][0]
    assert summary["name"] == "main" and summary["hit_rate_reported"] < 0.05
    assert abs(volatile["hit_rate_now"] - cached / prompt) < TOLERANCE  # the replay agrees with the replicas
    for needle in ("volatile values", "shorter than one 16-token block", "cache_salt", "mode: relocate"):
        assert needle in text

    actual = replayed_rate(fresh_fleet.urls, volatile["fix"]["patch"], bodies)
    assert actual > 0.5
    assert abs(actual - volatile["hit_rate_if_fixed"]) <= TOLERANCE, (actual, volatile["hit_rate_if_fixed"])


@pytest.mark.slow
def test_doctor_on_a_jsonl_file_names_the_causes_and_learns_an_unknown_id(
    fleet: ReplicaGroup, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path / "gateway.yaml", fleet.urls, [route("report")])
    plain = write_jsonl(tmp_path / "plain.jsonl", planted_traffic(30))
    assert_names_the_planted_causes(doctor(capsys, "--file", str(plain), "--config", str(config)))

    # the same traffic with a session code no detector knows: doctor diffs the texts and suggests a rule
    bodies = planted_traffic(30, unknown_id=True)
    report = doctor(capsys, "--file", str(write_jsonl(tmp_path / "ids.jsonl", bodies)), "--config", str(config))
    learned = finding(report, "learned_span")
    (span,) = learned["data"]["spans"]
    assert span["where"] == "messages[0]" and span["left"].endswith("Session code: ")
    rules = learned["fix"]["patch"]["normalize"]["rules"]
    assert rules == [{"name": "learned_1", "pattern": span["suggested_rule"]["pattern"]}]
    pattern = re.compile(span["suggested_rule"]["pattern"])
    codes = [re.search(r"Session code: (\S+)\.", b["messages"][0]["content"]) for b in bodies if "messages" in b]
    assert all(pattern.search(f"Session code: {m.group(1)}").group(0) == m.group(1) for m in codes if m)
    assert learned["gain"] > 0.5

    actual = replayed_rate(fleet.urls, learned["fix"]["patch"], bodies)
    assert actual > 0.5
    assert abs(actual - learned["hit_rate_if_fixed"]) <= TOLERANCE, (actual, learned["hit_rate_if_fixed"])


def test_doctor_reports_what_it_cannot_see(
    shared_fleet: ReplicaGroup, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFIX_GATEWAY_ADMIN_KEY", ADMIN_KEY)
    with gateway(shared_fleet.urls, [route("report")]) as gw:
        report = doctor(capsys, "--gateway", gw.url)
        assert any("samples.enabled" in note for note in report["notes"])
        assert main(["doctor", "--gateway", gw.url, "--admin-key", "wrong"]) == 1
        assert "401" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"model": "demo-model", "messages": []}\nnot json\n{"model": "nope", "prompt": "x"}\n')
    config = write_config(tmp_path / "gateway.yaml", shared_fleet.urls, [route("report")])
    capsys.readouterr()
    # nothing in it can be analysed: said plainly, with a non-zero status (JSON still printed for tools)
    assert main(["doctor", "--file", str(bad), "--config", str(config), "--json"]) == 1
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert "none of the 2 requests" in captured.err
    notes = "\n".join(report["notes"])
    assert "line 2: not valid JSON" in notes and "request 1: 400" in notes and "request 2: 404" in notes
    assert main(["doctor", "--file", str(tmp_path / "missing.jsonl"), "--config", str(config)]) == 1


@pytest.mark.slow
def test_doctor_learns_an_unknown_span_from_a_gateway_that_keeps_text(
    shared_fleet: ReplicaGroup, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the debug setting samples.include_text, the gateway source can be diffed like a file."""
    monkeypatch.setenv("PREFIX_GATEWAY_ADMIN_KEY", ADMIN_KEY)
    with gateway(shared_fleet.urls, [route("report")], samples={"enabled": True, "include_text": True}) as gw:
        send(gw, planted_traffic(18, unknown_id=True))
        report = doctor(capsys, "--gateway", gw.url)
    (span,) = finding(report, "learned_span")["data"]["spans"]
    assert span["where"] == "messages[0]" and span["left"].endswith("Session code: ")
    assert finding(report, "volatile_span")["data"]["rules"]
