"""``prefix-gateway doctor --file`` on traffic the config's routes do not serve.

The packaged default config routes only the demo's model: before, a sample of any other
model's traffic was routed to a 404 request by request and the report closed with "No cause
of misses found" — a clean bill of health for requests never analysed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.config import packaged_default_config

MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # no route of the default config serves it
SYSTEM = "You are the support assistant of ACME. Answer in two sentences. " * 20


def _sample(tmp_path: Path, n: int = 12) -> Path:
    path = tmp_path / "traffic.jsonl"
    rows = [
        {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": f"Request id {1000 + i:x}-{i * 7919:x}. {SYSTEM}"},
                {"role": "user", "content": f"question {i}: where is my order?"},
            ],
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_without_config_every_models_requests_are_analysed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # no ./config/gateway.yaml: the packaged default
    assert main(["doctor", "--file", str(_sample(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "No cause of misses found" not in out
    assert "route any-model" in out and "12 requests" in out
    assert "no --config given" in out  # says which settings keyed them
    assert "volatile span" in out and "(?<=Request\\ id\\ )" in out  # the id at the top: a cause, and its rule


def test_with_a_config_that_routes_none_of_them_it_says_so_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(["doctor", "--file", str(_sample(tmp_path)), "--config", str(packaged_default_config())])
    captured = capsys.readouterr()
    assert status == 1
    assert "No cause of misses found" not in captured.out + captured.err
    assert "none of the 12 requests" in captured.err
    assert f"12 requests for model '{MODEL}' matched no route" in captured.err
