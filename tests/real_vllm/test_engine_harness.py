"""The lane's harness without an engine (main suite): tokenizer inputs, launch flags, clean stops."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import quicktok
import tiktoken
from tiktoken.load import load_tiktoken_bpe

from tests.polling import wait_for
from tests.real_vllm import engine
from tests.real_vllm.model_builder import PATTERN


def test_special_tokens_are_llama31s_at_the_ids_quicktok_gives_them() -> None:
    names = engine.llama31_specials()
    assert len(names) == len(set(names)) == 256
    ids = {n: 128000 + i for i, n in enumerate(names)}
    for name, token_id in engine.quicktok_specials().items():
        if not name.startswith("<|reserved_special_token_"):
            assert ids[name] == token_id, name
    assert ids["<|begin_of_text|>"] == 128000 and ids["<|eot_id|>"] == 128009
    assert ids["<|eom_id|>"] == 128008 and ids["<|python_tag|>"] == 128010  # Llama 3.1's tool tokens
    assert names[-1] == "<|reserved_special_token_247|>"


def test_the_tiktoken_file_from_quicktoks_ranks_encodes_like_quicktok(tmp_path: Path) -> None:
    """The ranks the model's tokenizer.json is built from are quicktok's llama3, exactly."""
    path = tmp_path / "llama3.tiktoken"
    engine.write_tiktoken_file(path)
    ranks = load_tiktoken_bpe(str(path))
    assert len(ranks) == 128000 and sorted(ranks.values()) == list(range(128000))
    enc = tiktoken.Encoding("llama3-lane", pat_str=PATTERN, mergeable_ranks=ranks, special_tokens={})
    ours = quicktok.get_encoding("llama3")
    for text in (
        "Hello, world!  Ünïcode\n\n\ttabs 123456 don't",
        "def f(x):\n    return x**2  # ok",
        "日本語のテキスト",
    ):
        assert enc.encode_ordinary(text) == ours.encode_ordinary(text)


def test_a_replica_is_launched_with_the_lanes_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIX_GATEWAY_REAL_VLLM_HOME", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    eng = engine.Engine(python=tmp_path / "python", model=tmp_path / "model")
    r = eng.replica(1, ["--num-gpu-blocks-override", "64"])
    cmd = r.command(eng.python, eng.model)
    assert len({r.port, r.events_port, r.replay_port}) == 3
    assert all(engine.PORT_RANGE[0] <= p < engine.PORT_RANGE[1] for p in (r.port, r.events_port, r.replay_port))
    for flag in ("--enable-prefix-caching", "--enable-prompt-tokens-details", "--enforce-eager"):
        assert flag in cmd
    assert cmd[cmd.index("--served-model-name") + 1] == "meta-llama/Llama-3.1-8B-Instruct"
    assert cmd[cmd.index("--max-model-len") + 1] == "8192"
    assert cmd[-2:] == ["--num-gpu-blocks-override", "64"]
    events = json.loads(cmd[cmd.index("--kv-events-config") + 1])
    assert events["endpoint"] == f"tcp://*:{r.events_port}" and events["replay_endpoint"] == f"tcp://*:{r.replay_port}"
    env = r.env()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(r.core) and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["VLLM_CACHE_ROOT"].startswith(str(tmp_path)) and "PYTHONPATH" not in env
    assert r.log_path.parent == tmp_path / "logs"


def test_stop_ends_the_whole_process_group(tmp_path: Path) -> None:
    """A replica is several processes (API server, engine core, worker): stop leaves none running."""
    r = engine.Replica(0, 0, 1, 2, 3, tmp_path / "log")
    r.process = subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 300 & sleep 300 & wait"], start_new_session=True)
    pgid = r.process.pid
    wait_for(lambda: _group_members(pgid) >= 3, 10, 0.02, "the child processes")
    r.stop(timeout=0.5)  # the group ignores SIGTERM: SIGKILL after the timeout
    wait_for(lambda: _group_members(pgid) == 0, 10, 0.02, "the group to be gone")
    assert r.process is None


def _group_members(pgid: int) -> int:
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                count += 1
    return count


class _Options:
    def __init__(self, expression: str) -> None:
        self.expression = expression

    def getoption(self, name: str) -> str:
        assert name == "-m"
        return self.expression


@pytest.mark.parametrize(
    ("expression", "env", "selected"),
    [
        ("", "", False),
        ("not slow", "", False),
        ("real_vllm", "", True),
        ("not real_vllm", "", False),
        ("", "1", True),
        ("", "0", False),
    ],
)
def test_the_lane_runs_only_when_asked(
    expression: str, env: str, selected: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.real_vllm.conftest import lane_requested

    monkeypatch.setenv("PREFIX_GATEWAY_REAL_VLLM", env)
    assert lane_requested(_Options(expression)) is selected  # type: ignore[arg-type]


_SIGTERMED = """
import subprocess, sys, time
from pathlib import Path
from tests.real_vllm import engine
r = engine.Replica(0, 0, 1, 2, 3, Path(sys.argv[1]))
r.process = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300 & wait"], start_new_session=True)
engine._RUNNING.add(r)
engine.stop_on_sigterm()
print(r.process.pid, flush=True)
time.sleep(300)
"""


def test_a_run_sent_sigterm_leaves_no_replica_running(tmp_path: Path) -> None:
    """CI timeouts and `kill` send SIGTERM: the replicas' groups still go (atexit), not orphaned."""
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", _SIGTERMED, str(tmp_path / "log")],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.stdout is not None
    pgid = int(proc.stdout.readline())
    wait_for(lambda: _group_members(pgid) >= 3, 10, 0.02, "the child processes")
    proc.terminate()
    proc.wait(timeout=30)
    wait_for(lambda: _group_members(pgid) == 0, 10, 0.02, "the group to be gone")
