"""The demo's admin key file: private, never written through a link, read only for the demo's own address."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.admin.local_key import demo_key_for, key_file, remove_demo_key, write_demo_key


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "state"
    monkeypatch.setenv("PREFIX_GATEWAY_STATE_DIR", str(directory))
    return directory


def test_written_private_and_read_for_exactly_that_address(state: Path) -> None:
    path = write_demo_key("127.0.0.1", 18080, "k-1")
    assert path == key_file(18080) and path.stat().st_mode & 0o777 == 0o600
    assert state.stat().st_mode & 0o077 == 0
    assert demo_key_for("http://127.0.0.1:18080") == "k-1"
    assert demo_key_for("http://127.0.0.1:18081") is None  # another port
    assert demo_key_for("http://[::1]:18080") is None  # another loopback host: maybe another listener
    assert demo_key_for("http://localhost:18080") is None  # a name, not the address the demo bound
    assert demo_key_for("http://10.1.2.3:18080") is None  # never sent off the machine
    remove_demo_key(18080)
    assert demo_key_for("http://127.0.0.1:18080") is None


def test_a_link_planted_at_the_key_path_is_replaced_not_followed(state: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    victim.chmod(0o644)
    state.mkdir(mode=0o700)
    key_file(18080).symlink_to(victim)
    write_demo_key("127.0.0.1", 18080, "k-2")
    assert victim.read_text() == "precious\n" and victim.stat().st_mode & 0o777 == 0o644
    assert not key_file(18080).is_symlink() and demo_key_for("http://127.0.0.1:18080") == "k-2"


def test_a_file_others_can_read_or_a_shared_directory_is_refused(state: Path) -> None:
    write_demo_key("127.0.0.1", 18080, "k-3")
    key_file(18080).chmod(0o644)
    assert demo_key_for("http://127.0.0.1:18080") is None
    state.chmod(0o777)
    with pytest.raises(OSError, match="writable by other users"):
        write_demo_key("127.0.0.1", 18080, "k-3")


def test_a_key_left_by_a_demo_that_died_is_not_sent(state: Path) -> None:
    write_demo_key("127.0.0.1", 18080, "k-4")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    record = json.loads(key_file(18080).read_text())
    key_file(18080).write_text(json.dumps({**record, "pid": int(dead.stdout)}))
    os.chmod(key_file(18080), 0o600)
    assert demo_key_for("http://127.0.0.1:18080") is None
