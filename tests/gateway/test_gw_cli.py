"""The CLI: serve (file or quick start), demo, hash-key, and dispatch to the simulator's CLI."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from gw_helpers import MODEL, chat, wait_for
from openai import OpenAI

from gateway.cli import build_parser, build_serve_config, main
from gateway.config import packaged_default_config, sha256_hex

ROOT = Path(__file__).resolve().parents[2]


def test_hash_key_reads_stdin_by_default(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("s3cret\n"))  # `prefix-gateway hash-key < key.txt`
    assert main(["hash-key"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == sha256_hex("s3cret") and out.err == ""
    monkeypatch.setattr(sys, "stdin", io.StringIO("one\ntwo\n"))
    assert main(["hash-key"]) == 2 and "one key" in capsys.readouterr().err
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert main(["hash-key"]) == 2 and "no key" in capsys.readouterr().err


def test_hash_key_prompts_without_echo_on_a_terminal(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdin", Terminal("never read"))
    monkeypatch.setattr("getpass.getpass", lambda prompt="": "typed")
    assert main(["hash-key"]) == 0
    assert capsys.readouterr().out.strip() == sha256_hex("typed")


def test_hash_key_argument_still_works_but_warns(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hash-key", "s3cret"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == sha256_hex("s3cret")
    assert "shell history" in out.err and "s3cret" not in out.err


def test_sim_is_dispatched_verbatim(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["sim", "--help"])
    assert info.value.code == 0
    assert "prefix-gateway sim" in capsys.readouterr().out


def test_serve_builds_quick_start_and_file_configs() -> None:
    args = build_parser().parse_args(["serve", "--replica", "http://a:1", "--replica", "http://b:2", "--policy",
                                      "round_robin", "--port", "9999"])  # fmt: skip
    config = build_serve_config(args)
    assert [r.url for r in config.replicas] == ["http://a:1", "http://b:2"]
    assert config.routes[0].policy == "round_robin" and config.server.port == 9999
    args = build_parser().parse_args(["serve", "--config", str(packaged_default_config()), "--port", "0"])
    config = build_serve_config(args)
    assert config.server.port == 0 and len(config.replicas) == 4 and config.routes[0].name == "demo"


@pytest.fixture
def popen_cli() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


def start_cli(procs: list[subprocess.Popen[str]], *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    procs.append(proc)
    return proc


def read_until(proc: subprocess.Popen[str], pattern: str, timeout: float = 60.0) -> tuple[re.Match[str], str]:
    """Read the process output line by line until ``pattern`` matches (bounded by a deadline)."""
    seen: list[str] = []
    found: list[re.Match[str]] = []

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            match = re.search(pattern, line)
            if match:
                found.append(match)
                return

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    thread.join(timeout)
    if not found:
        raise AssertionError(f"{pattern!r} not printed in {timeout}s; output:\n{''.join(seen)}")
    return found[0], "".join(seen)


@pytest.mark.slow
def test_serve_quick_start(sim_urls: list[str], popen_cli: list[subprocess.Popen[str]]) -> None:
    proc = start_cli(popen_cli, "serve", "--replica", sim_urls[0], "--replica", sim_urls[1], "--port", "0")
    match, _ = read_until(proc, r"listening on (http://127\.0\.0\.1:\d+)")
    reply = OpenAI(base_url=match.group(1) + "/v1", api_key="x").chat.completions.create(
        model=MODEL, messages=chat("hi"), max_tokens=2
    )
    assert reply.usage.completion_tokens == 2
    proc.send_signal(signal.SIGTERM)  # what Kubernetes sends: graceful shutdown, then a clean exit
    assert proc.wait(20) == 0


@pytest.mark.slow
def test_demo_starts_replicas_and_gateway(
    popen_cli: list[subprocess.Popen[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFIX_GATEWAY_STATE_DIR", str(tmp_path))  # where the demo leaves its admin key
    monkeypatch.delenv("PREFIX_GATEWAY_ADMIN_KEY", raising=False)
    proc = start_cli(popen_cli, "demo", "--port", "0", "--time-scale", "0")
    match, _ = read_until(proc, r"4 simulated vLLM replicas behind (http://127\.0\.0\.1:\d+/v1)")
    base = match.group(1)
    _, banner = read_until(proc, r"Ctrl-C stops everything")
    assert f'OpenAI(base_url="{base}"' in banner and f"curl -s {base}/chat/completions" in banner
    client = OpenAI(base_url=base, api_key="unused")

    def replica_for(text: str) -> str:
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=chat(text), max_tokens=2)
        return raw.headers["x-prefix-gateway-replica"]

    # The demo routes by prefix: different prompts spread over the replicas, a repeat stays.
    first = {f"question {i}: what is {i} squared?": None for i in range(8)}
    for text in first:
        first[text] = replica_for(text)
    assert len(set(first.values())) > 1  # several simulated replicas behind it
    assert all(replica_for(text) == replica for text, replica in first.items())
    # The admin API is on with a key the demo generated and printed: /admin/stats answers it, and
    # `doctor --gateway` on this machine finds the key by itself and prints a report.
    url = base.removesuffix("/v1")
    key = re.search(r"Admin API \(stats, explain, doctor\): key (\S+)", banner).group(1)
    assert httpx.get(f"{url}/admin/stats", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert httpx.get(f"{url}/admin/stats").status_code == 401
    doctor = subprocess.run(
        [sys.executable, "-m", "gateway", "doctor", "--gateway", url],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert doctor.returncode == 0, doctor.stderr
    assert f"prefix-gateway doctor: {url}" in doctor.stdout and "route demo" in doctor.stdout
    key_files = list(tmp_path.glob("demo-admin-key-*"))
    assert len(key_files) == 1 and key_files[0].stat().st_mode & 0o077 == 0  # only its user can read it
    replica_pids = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                                   text=True).stdout.split()]  # fmt: skip
    assert len(replica_pids) == 4
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 0
    for pid in replica_pids:  # the simulated replicas were stopped too
        wait_for(lambda pid=pid: not Path(f"/proc/{pid}").exists() or "Z" in _state(pid), what=f"replica {pid} to exit")
    assert not list(tmp_path.glob("demo-admin-key-*"))  # the key goes with the demo


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"
