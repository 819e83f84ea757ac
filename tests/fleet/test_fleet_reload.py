"""Live reconfiguration: a changed config file (or SIGHUP) swaps routes and pools without dropping requests.

The file is replaced the way Kubernetes updates a mounted ConfigMap: ``gateway.yaml`` is a
symlink into ``..data``, itself a symlink that is swapped atomically to a new directory.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from openai import OpenAI

from gateway.http.server import RunningGateway, serve_in_thread
from gateway.sim.launcher import ReplicaGroup
from tests.configs import gateway_config
from tests.fleet.fleet_helpers import MODEL, SLOW, Load
from tests.polling import wait_for

_versions = itertools.count()


class ConfigMapDir:
    """``dir/gateway.yaml -> ..data/gateway.yaml``, ``..data -> ..<version>``: swapped like the kubelet does."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.path = root / "gateway.yaml"

    def write(self, data: dict[str, Any] | str) -> None:
        version = self.root / f"..{next(_versions)}"
        version.mkdir()
        text = data if isinstance(data, str) else yaml.safe_dump(data)
        (version / "gateway.yaml").write_text(text)
        tmp = self.root / "..data_tmp"
        os.symlink(version.name, tmp)
        os.replace(tmp, self.root / "..data")  # atomic swap
        if not self.path.is_symlink():
            os.symlink("..data/gateway.yaml", self.path)


def file_config(urls: list[str], pool: list[str], route: str = "main", policy: str = "prefix") -> dict[str, Any]:
    data = gateway_config(urls).model_dump(mode="json", exclude_unset=True)
    data["routes"] = [{"name": route, "match": {"models": [MODEL]}, "policy": policy, "replicas": pool}]
    return data


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    with ReplicaGroup(3, log_dir=tmp_path_factory.mktemp("sims"), **SLOW).start() as group:
        yield group.urls


@pytest.fixture
def configmap(tmp_path: Path) -> ConfigMapDir:
    return ConfigMapDir(tmp_path / "config")


def serve_file(cm: ConfigMapDir, data: dict[str, Any]) -> Any:
    (cm.root).mkdir(exist_ok=True)
    cm.write(data)
    return serve_in_thread(gateway_config([], **data), config_path=cm.path, reload_poll_s=0.05)


def ask(gw: RunningGateway) -> tuple[str, str]:
    client = OpenAI(base_url=gw.openai_base_url, api_key="unused", max_retries=0, timeout=30)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=2
    )
    raw.parse()
    return raw.headers["x-prefix-gateway-route"], raw.headers["x-prefix-gateway-replica"]


@pytest.mark.slow
def test_a_route_change_takes_effect_on_the_next_request(sims: list[str], configmap: ConfigMapDir) -> None:
    with serve_file(configmap, file_config(sims, ["r0"], route="first")) as gw:
        assert ask(gw) == ("first", "r0")
        configmap.write(file_config(sims, ["r1"], route="second", policy="least_loaded"))
        wait_for(lambda: gw.gateway.reloads["ok"] == 1, what="the reload")
        assert ask(gw) == ("second", "r1")
        runner = gw.gateway.routes.get("second").runner  # type: ignore[union-attr]
        assert runner.policy_name == "least_loaded" and [r.name for r in runner.replicas] == ["r1"]


def test_an_invalid_file_keeps_the_old_config_and_says_why(
    sims: list[str], configmap: ConfigMapDir, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="prefix_gateway.reload")
    with serve_file(configmap, file_config(sims, ["r0"])) as gw:
        bad = file_config(sims, ["r1"])
        bad["routes"][0]["policy"] = "fastest"
        configmap.write(bad)
        wait_for(lambda: gw.gateway.reloads["rejected"] == 1, what="the rejection")
        error = gw.gateway.reloader.last_error or ""  # type: ignore[union-attr]
        assert f"{configmap.path}: routes[0].policy: unknown policy 'fastest'" in error
        bad["routes"][0]["policy"] = "prefix"
        bad["health"]["interval_s"] = -1
        configmap.write(bad)
        wait_for(lambda: gw.gateway.reloads["rejected"] == 2, what="the second rejection")
        assert "health.interval_s: Input should be greater than 0" in (gw.gateway.reloader.last_error or "")  # type: ignore[union-attr]
        assert "routes[0].policy: unknown policy 'fastest'" in caplog.text
        assert ask(gw) == ("main", "r0")  # the old config serves
        configmap.write("replicas: [unclosed\n")
        wait_for(lambda: gw.gateway.reloads["rejected"] == 3, what="the YAML error")
        assert "invalid YAML" in (gw.gateway.reloader.last_error or "")  # type: ignore[union-attr]
        assert ask(gw) == ("main", "r0")
        metrics = httpx.get(f"{gw.url}/metrics", timeout=10).text
        assert 'prefix_gateway_config_reloads_total{outcome="rejected"} 3.0' in metrics


@pytest.mark.slow
def test_no_request_fails_during_20_reloads_under_load(sims: list[str], configmap: ConfigMapDir) -> None:
    variants = [
        file_config(sims, ["r0", "r1"]),
        file_config(sims, ["r0", "r1", "r2"], policy="least_loaded"),
        file_config(sims, ["r1", "r2"]),
        file_config(sims, ["r2"], route="other", policy="round_robin"),
    ]
    variants[2]["replicas"] = variants[2]["replicas"][1:]  # r0 leaves the file: it drains
    with serve_file(configmap, variants[0]) as gw, Load(gw.openai_base_url) as load:
        wait_for(lambda: load.ok >= 5, what="traffic")
        for i in range(1, 21):
            configmap.write(variants[i % len(variants)])
            wait_for(lambda i=i: gw.gateway.reloads["ok"] == i, what=f"reload {i}")
            done = load.ok
            wait_for(lambda done=done: load.ok >= done + 2, what=f"traffic after reload {i}")
    assert load.failures == []
    assert gw.gateway.reloads == {"ok": 20, "rejected": 0, "unchanged": 0}
    assert set(load.replicas) == {"r0", "r1", "r2"}


@pytest.mark.slow
def test_sighup_reloads_the_file(sims: list[str], configmap: ConfigMapDir, tmp_path: Path) -> None:
    from tests.fleet.fleet_helpers import shared_free_port

    port = shared_free_port(["127.0.0.1"])
    configmap.root.mkdir()
    first = file_config(sims, ["r0"], route="before")
    first["server"] = {"host": "127.0.0.1", "port": port}
    configmap.write(first)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(configmap.path)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        url = f"http://127.0.0.1:{port}"

        def route() -> str | None:
            try:
                response = httpx.post(
                    f"{url}/v1/chat/completions",
                    json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
                    timeout=5,
                )
            except httpx.HTTPError:
                return None
            return response.headers.get("x-prefix-gateway-route")

        assert wait_for(route, timeout=30, what="the gateway serving") == "before"
        # rewrite the file in place with the same size and mtime: only SIGHUP can reveal it
        target = configmap.path.resolve()
        stat = target.stat()
        text = target.read_text()
        target.write_text(text.replace("name: before", "name: after_"))
        os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert route() == "before"
        process.send_signal(signal.SIGHUP)
        wait_for(lambda: route() == "after_", what="the route renamed by the reload")
    finally:
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=30)
    assert "config reload (SIGHUP) applied" in err.decode()
