"""Replica discovery: pools follow DNS answers and EndpointSlices while requests keep flowing.

Replicas join and leave under steady streaming load; every request must complete (a leaving
replica drains: no new requests, running streams finish), the ring moves only the keys that
belong to a joining replica, and the changes show in ``/admin/stats`` and ``/metrics``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import gateway.discovery.dns as dns_module
from gateway.http.server import RunningGateway
from tests.fleet.fleet_helpers import (
    ADMIN_KEY,
    MODEL,
    Load,
    discovered_gateway,
    healthy_pool,
    loopback_replicas,
    metrics,
    pool,
    stats,
)
from tests.fleet.kube_api import endpoint_slice, run_kube_api
from tests.polling import wait_for


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, list[str]]]:
    with loopback_replicas(3, tmp_path_factory.mktemp("sims")) as found:
        yield found


def homes(gw: RunningGateway, n: int = 60) -> list[str]:
    """Where ``n`` distinct prompts would go now (dry run: nothing is recorded)."""
    out = []
    with httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10) as http:
        for i in range(n):
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"Topic {i}: " + "context. " * 60}]}
            response = http.post("/admin/explain", json=body)
            response.raise_for_status()
            out.append(response.json()["decision"]["replica"])
    return out


@pytest.mark.slow
def test_a_dns_name_whose_answers_change(
    replicas: tuple[int, list[str]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    port, addresses = replicas
    answer = addresses[:2]

    async def stub_resolver(host: str, _port: int) -> list[str]:
        if host != "vllm.ml.svc.cluster.local":
            raise OSError(f"unknown host {host}")
        if not answer:
            raise OSError("SERVFAIL")
        return list(answer)

    monkeypatch.setattr(dns_module, "system_resolver", stub_resolver)
    monkeypatch.setenv("PREFIX_GATEWAY_ADMIN_KEY", ADMIN_KEY)
    source = {"name": "vllm", "dns": {"host": "vllm.ml.svc.cluster.local", "port": port, "interval_s": 0.05}}
    a, b, c = (f"vllm-{addr}" for addr in addresses)
    with discovered_gateway(source) as gw:
        wait_for(lambda: healthy_pool(gw) == [a, b], what="the first answer's replicas in the pool")
        before = homes(gw)
        assert set(before) == {a, b}

        with Load(gw.openai_base_url) as load:
            wait_for(lambda: load.ok >= 10, what="traffic through both replicas")
            answer[:] = addresses  # a third pod: it joins
            wait_for(lambda: healthy_pool(gw) == [a, b, c], what="the new replica in the pool")
            wait_for(lambda: load.replicas[c] >= 3, what="traffic reaching the new replica")
            answer[:] = [addresses[1], addresses[2]]  # the first one goes away: it drains
            wait_for(lambda: pool(gw) == [b, c], what="the old replica out of the pool")
            served_a = load.replicas[a]
            answer[:] = []  # DNS fails: the last answer stays
            wait_for(lambda: gw.gateway.membership.sources["vllm"].errors >= 3, what="failed lookups")
            assert pool(gw) == [b, c]
            answer[:] = [addresses[1], addresses[2]]
            done = load.ok
            wait_for(lambda: load.ok >= done + 10, what="more traffic after the changes")
            assert load.replicas[a] <= served_a + load.workers  # only requests already running there
        assert load.failures == []
        wait_for(lambda: not gw.gateway.membership.draining, what="the old replica drained")

        after = homes(gw)
        assert set(after) == {b, c}
        # consistent hashing: a prompt moved only if its replica left (a) or to the one that joined (c)
        kept = [i for i, home in enumerate(before) if home == b]
        assert all(after[i] == b or after[i] == c for i in kept)
        moved_from_b = sum(1 for i in kept if after[i] != b)
        assert moved_from_b <= len(kept) * 0.7, "most of b's keys must stay on b"

        snapshot = stats(gw)["membership"]
        vllm = snapshot["sources"]["vllm"]
        assert vllm["members"] == [b, c] and vllm["added"] == 3 and vllm["removed"] == 1
        assert snapshot["draining"] == [] and snapshot["drained"] == 1
        m = metrics(gw)
        labels = (("kind", "dns"), ("source", "vllm"))
        assert m[("prefix_gateway_discovery_replicas", labels)] == 2
        assert m[("prefix_gateway_discovery_changes_total", (("change", "removed"), *labels))] == 1
        assert m[("prefix_gateway_discovery_errors_total", labels)] >= 3
        assert m[("prefix_gateway_replicas_draining", ())] == 0


@pytest.mark.slow
def test_endpointslices_list_and_watch(replicas: tuple[int, list[str]], tmp_path: Path, monkeypatch: Any) -> None:
    port, addresses = replicas
    monkeypatch.setenv("PREFIX_GATEWAY_ADMIN_KEY", ADMIN_KEY)
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text("sa-token-1\n")
    (account / "namespace").write_text("ml\n")
    pods = {"vllm-0": (addresses[0], True), "vllm-1": (addresses[1], True), "vllm-2": (addresses[2], False)}
    with run_kube_api("ml", "sa-token-1") as api:
        api.put(endpoint_slice("vllm-abc12", "vllm", port, pods))
        source = {
            "name": "k8s",
            "kubernetes": {
                "label_selector": "kubernetes.io/service-name=vllm",
                "api_url": api.url,
                "service_account_dir": str(account),
                "resync_s": 30,
            },
        }
        with discovered_gateway(source) as gw:
            wait_for(lambda: healthy_pool(gw) == ["k8s-vllm-0", "k8s-vllm-1"], what="the ready pods")
            assert api.selectors[0] == "kubernetes.io/service-name=vllm" and api.unauthorized == 0
            with Load(gw.openai_base_url) as load:
                wait_for(lambda: load.ok >= 10, what="traffic")
                pods["vllm-2"] = (addresses[2], True)  # becomes ready
                api.put(endpoint_slice("vllm-abc12", "vllm", port, pods))
                wait_for(lambda: healthy_pool(gw) == ["k8s-vllm-0", "k8s-vllm-1", "k8s-vllm-2"], what="vllm-2 in")
                wait_for(lambda: load.replicas["k8s-vllm-2"] >= 3, what="traffic on vllm-2")
                pods["vllm-0"] = (addresses[0], False)  # terminating: not ready, drains
                api.put(endpoint_slice("vllm-abc12", "vllm", port, pods))
                wait_for(lambda: pool(gw) == ["k8s-vllm-1", "k8s-vllm-2"], what="vllm-0 out")
                # the watch expires (410): the gateway lists again and loses nothing
                lists = api.lists
                api.expire_watches()
                wait_for(lambda: api.lists > lists, what="a fresh list after 410 Gone")
                # vllm-1 moves to its own slice, then the old slice is deleted
                api.put(endpoint_slice("vllm-def34", "vllm", port, {"vllm-1": pods["vllm-1"]}))
                del pods["vllm-1"]
                api.delete("vllm-abc12")
                wait_for(lambda: pool(gw) == ["k8s-vllm-1"], what="only vllm-1 left")
                done = load.ok
                wait_for(lambda: load.ok >= done + 10, what="traffic after the changes")
            assert load.failures == []
            assert set(load.replicas) == {"k8s-vllm-0", "k8s-vllm-1", "k8s-vllm-2"}
            wait_for(lambda: not gw.gateway.membership.draining, what="drained")
            snapshot = stats(gw)["membership"]["sources"]["k8s"]
            assert snapshot["members"] == ["k8s-vllm-1"] and snapshot["removed"] == 2 and snapshot["failing"] is None
            assert api.unauthorized == 0
