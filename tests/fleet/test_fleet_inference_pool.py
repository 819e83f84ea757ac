"""InferencePool discovery: the pods of a Gateway API Inference Extension pool, by list+watch.

Against the fake API server (``tests/fleet/kube_api.py``): pods that appear, turn unready,
terminate, lose their labels or go away; a selector change; two target ports; a watch that
expires (410: list again, nothing lost); RBAC refusals and a missing CRD named in ``failing``
(and by doctor); pools the gateway cannot read (no selector, no ports, the v1alpha2 API) keep the
last answer and say why.  The end-to-end test routes the official SDK's traffic to the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from gateway.config import parse_config
from gateway.config.loading import ConfigError
from gateway.discovery.inference_pool import InferencePoolSource, InvalidPool, pool_spec
from gateway.discovery.settings import InferencePoolSettings
from gateway.discovery.source import Endpoint
from gateway.discovery.stats import SourceStats
from gateway.doctor.analyses import diagnose
from gateway.doctor.model import Corpus
from tests.fleet.fleet_helpers import ADMIN_KEY, Load, discovered_gateway, healthy_pool, loopback_replicas, pool, stats
from tests.fleet.kube_api import FakeKubeApi, inference_pool, pod, run_kube_api
from tests.polling import until, wait_for

NS, TOKEN = "ml", "sa-token-7"
VLLM = {"app": "vllm"}


def service_account(tmp_path: Path) -> Path:
    account = tmp_path / "serviceaccount"
    account.mkdir(exist_ok=True)
    (account / "token").write_text(TOKEN + "\n")
    (account / "namespace").write_text(NS + "\n")
    return account


@pytest.fixture
def api() -> Iterator[FakeKubeApi]:
    with run_kube_api(NS, TOKEN) as fake:
        yield fake


class Watched:
    """An InferencePoolSource running in the test's loop, with everything it published."""

    def __init__(self, source: InferencePoolSource) -> None:
        self.source = source
        self.reports: list[list[Endpoint]] = []

    async def publish(self, endpoints: Sequence[Endpoint]) -> None:
        self.reports.append(list(endpoints))

    @property
    def now(self) -> dict[str, str]:
        return {e.name: e.url for e in self.reports[-1]} if self.reports else {}

    async def until(self, expected: dict[str, str], what: str) -> None:
        await until(lambda: self.now == expected, timeout=10, what=f"{what} (now {self.now})")


@contextlib.asynccontextmanager
async def watched(api: FakeKubeApi, tmp_path: Path, name: str = "vllm-pool") -> AsyncIterator[Watched]:
    settings = InferencePoolSettings(
        name=name, api_url=api.url, service_account_dir=str(service_account(tmp_path)), resync_s=60
    )
    out = Watched(InferencePoolSource("pool", settings, SourceStats("inference_pool")))
    task = asyncio.create_task(out.source.run(out.publish))
    try:
        yield out
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_pods_follow_readiness_labels_selector_and_ports(api: FakeKubeApi, tmp_path: Path) -> None:
    api.put(inference_pool("vllm-pool", VLLM, [8000]))
    api.put(pod("vllm-0", "10.0.0.10", VLLM))
    api.put(pod("vllm-1", "10.0.0.11", VLLM))
    api.put(pod("vllm-2", "10.0.0.12", VLLM, ready=False))
    api.put(pod("vllm-3", None, VLLM))  # scheduled, no IP yet
    api.put(pod("other-0", "10.0.0.20", {"app": "other"}))
    async with watched(api, tmp_path) as w:
        await w.until(
            {"pool-vllm-0-8000": "http://10.0.0.10:8000", "pool-vllm-1-8000": "http://10.0.0.11:8000"}, "ready pods"
        )
        assert api.label_selectors["pods"][0] == "app=vllm"  # the pool's selector, sent to the server
        api.put(pod("vllm-2", "10.0.0.12", VLLM))  # turns ready
        await w.until({**w.now, "pool-vllm-2-8000": "http://10.0.0.12:8000"}, "vllm-2 ready")
        api.put(pod("vllm-0", "10.0.0.10", VLLM, terminating=True))  # terminating: out before it is gone
        await until(lambda: "pool-vllm-0-8000" not in w.now, what="vllm-0 terminating")
        api.put(pod("vllm-1", "10.0.0.11", {"app": "moved"}))  # relabelled: the watch says DELETED
        await w.until({"pool-vllm-2-8000": "http://10.0.0.12:8000"}, "vllm-1 relabelled")
        api.delete("vllm-0", "Pod")
        # two target ports: one replica per (pod, port), the first port's name unchanged
        api.put(inference_pool("vllm-pool", VLLM, [8000, 8001]))
        await w.until(
            {"pool-vllm-2-8000": "http://10.0.0.12:8000", "pool-vllm-2-8001": "http://10.0.0.12:8001"}, "two ports"
        )
        # the watch expires (410 Gone): both collections are listed again, nothing is lost
        pool_lists, pod_lists = api.lists_of["inferencepools"], api.lists_of["pods"]
        api.expire_watches()
        await until(lambda: api.lists_of["inferencepools"] > pool_lists and api.lists_of["pods"] > pod_lists)
        api.put(pod("vllm-4", "10.0.0.14", VLLM))  # seen by the new watch
        await until(lambda: "pool-vllm-4-8001" in w.now, what="a pod after the relist")
        # the selector changes: the pod watch starts over with the new one
        api.put(pod("b-0", "10.0.1.10", {"app": "vllm-b"}))
        api.put(inference_pool("vllm-pool", {"app": "vllm-b"}, [9000]))
        await w.until({"pool-b-0-9000": "http://10.0.1.10:9000"}, "the new selector's pods")
        assert api.label_selectors["pods"][-1] == "app=vllm-b"
        assert w.source.stats.failing is None and api.unauthorized == 0


async def test_a_pool_the_gateway_cannot_read_keeps_the_last_answer_and_says_why(
    api: FakeKubeApi, tmp_path: Path
) -> None:
    api.put(inference_pool("vllm-pool", VLLM, [8000]))
    api.put(pod("vllm-0", "10.0.0.10", VLLM))
    last = {"pool-vllm-0-8000": "http://10.0.0.10:8000"}
    async with watched(api, tmp_path) as w:
        await w.until(last, "the pool")
        stats = w.source.stats
        broken = inference_pool("vllm-pool", VLLM, [8000])
        broken["spec"]["selector"] = {}
        api.put(broken)
        await until(lambda: "no spec.selector.matchLabels" in (stats.failing or ""), what="no selector named")
        broken["spec"]["selector"] = {"matchLabels": VLLM}
        broken["spec"]["targetPorts"] = []
        api.put(broken)
        await until(lambda: "no spec.targetPorts" in (stats.failing or ""), what="no ports named")
        old = {
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": "vllm-pool"},
            "spec": {"selector": VLLM, "targetPortNumber": 8000},  # the v1alpha2 shape
        }
        api.put(old)
        await until(lambda: "v1alpha2" in (stats.failing or ""), what="the old API named")
        assert w.now == last  # every bad pool kept the last answer
        api.put(inference_pool("vllm-pool", VLLM, [8000]))
        await until(lambda: stats.failing is None, what="the pool readable again")
        # a deleted pool: nothing may be routed to it
        api.delete("vllm-pool", "InferencePool")
        await w.until({}, "the pool deleted")
        assert stats.failing == f"InferencePool {NS}/vllm-pool not found"


async def test_rbac_refusals_and_a_missing_crd_say_what_to_fix(api: FakeKubeApi, tmp_path: Path) -> None:
    api.put(inference_pool("vllm-pool", VLLM, [8000]))
    api.put(pod("vllm-0", "10.0.0.10", VLLM))
    api.forbidden.add("pods")
    async with watched(api, tmp_path) as w:
        stats = w.source.stats
        await until(lambda: stats.failing is not None, what="the refusal")
        assert "forbidden: the service account may not list pods in namespace ml" in (stats.failing or "")
        assert 'cannot list resource "pods"' in (stats.failing or "")  # the API server's own words
        assert stats.errors >= 1 and w.now == {}
        finding = only_finding(stats)
        assert finding.cause == "discovery_failing" and "Role" in finding.fix.summary
        api.forbidden.clear()  # RBAC fixed: the next retry (backoff 1 s) succeeds
        await w.until({"pool-vllm-0-8000": "http://10.0.0.10:8000"}, "the pods after RBAC is fixed")
        await until(lambda: stats.failing is None, what="no error")
    api.missing.add("inferencepools")
    async with watched(api, tmp_path) as w:
        await until(lambda: w.source.stats.failing is not None, what="the 404")
        assert "list inferencepools.inference.networking.k8s.io: not found (404)" in (w.source.stats.failing or "")
        assert "CRD" in (w.source.stats.failing or "") and only_finding(w.source.stats).fix.summary.startswith(
            "install the Gateway API Inference Extension CRDs"
        )


def only_finding(source: SourceStats) -> Any:
    corpus = Corpus(source="test", stats={"membership": {"sources": {"pool": source.as_dict()}}})
    (finding,) = diagnose(corpus).findings
    return finding


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"apiVersion": "inference.networking.x-k8s.io/v1alpha2"}, "this gateway reads inference.networking.k8s.io/v1"),
        ({"spec": None}, "has no spec"),
        ({"spec": {"selector": {"matchLabels": {}}, "targetPorts": [{"number": 1}]}}, "no spec.selector.matchLabels"),
        ({"spec": {"selector": {"matchLabels": {"a": 1}}, "targetPorts": [{"number": 1}]}}, "map label names"),
        ({"spec": {"selector": {"matchLabels": {"a": "b"}}}}, "no spec.targetPorts"),
        ({"spec": {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 0}]}}, "no valid number"),
        ({"spec": {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": ["8000"]}}, "no valid number"),
        ({"spec": {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 1}] * 2}}, "listed twice"),
        (
            {"spec": {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": n} for n in range(1, 10)]}},
            "at most 8",
        ),
    ],
)
def test_pool_objects_that_are_not_v1_pools(change: dict[str, Any], message: str) -> None:
    obj = {**inference_pool("p", VLLM, [8000]), **change}
    with pytest.raises(InvalidPool, match=message):
        pool_spec(obj, "ml/p")


def test_check_config_validates_the_source() -> None:
    good = parse_config({"discovery": [{"name": "pool", "inference_pool": {"name": "vllm-pool"}}]})
    (source,) = good.discovery
    assert source.kind == "inference_pool" and source.inference_pool is not None
    for bad, words in [
        ({"name": "pool", "inference_pool": {"name": "Not_A_Name"}}, "name"),
        ({"name": "pool", "inference_pool": {"name": "p"}, "dns": {"host": "x"}}, "exactly one of"),
        ({"name": "pool", "inference_pool": {}}, "name"),
        ({"name": "pool", "inference_pool": {"name": "p", "label_selector": "a=b"}}, "label_selector"),
    ]:
        with pytest.raises(ConfigError, match=words):
            parse_config({"discovery": [bad]})


@pytest.mark.slow
def test_the_gateway_routes_to_the_pools_ready_pods(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("PREFIX_GATEWAY_ADMIN_KEY", ADMIN_KEY)
    account = service_account(tmp_path)
    with loopback_replicas(3, tmp_path / "sims") as (port, addresses), run_kube_api(NS, TOKEN) as api:
        api.put(inference_pool("vllm-pool", VLLM, [port]))
        for i, address in enumerate(addresses):
            api.put(pod(f"vllm-{i}", address, VLLM, ready=i < 2))
        source = {
            "name": "pool",
            "inference_pool": {"name": "vllm-pool", "api_url": api.url, "service_account_dir": str(account)},
        }
        names = [f"pool-vllm-{i}-{port}" for i in range(3)]
        with discovered_gateway(source) as gw:
            wait_for(lambda: healthy_pool(gw) == names[:2], what="the ready pods")
            with Load(gw.openai_base_url) as load:
                wait_for(lambda: load.ok >= 10, what="traffic")
                api.put(pod("vllm-2", addresses[2], VLLM))
                wait_for(lambda: load.replicas[names[2]] >= 3, what="traffic on vllm-2")
                api.put(pod("vllm-0", addresses[0], VLLM, ready=False))
                wait_for(lambda: pool(gw) == names[1:], what="vllm-0 out")
                done = load.ok
                wait_for(lambda: load.ok >= done + 10, what="traffic after the change")
            assert load.failures == []
            row = stats(gw)["membership"]["sources"]["pool"]
            assert row["kind"] == "inference_pool" and row["members"] == names[1:] and row["failing"] is None
            api.forbidden.add("pods")
            api.expire_watches()  # the relist is refused: the pool stays, the error shows
            wait_for(lambda: stats(gw)["membership"]["sources"]["pool"]["failing"], what="the 403 in /admin/stats")
            row = stats(gw)["membership"]["sources"]["pool"]
            assert "forbidden" in row["failing"] and "list pods" in row["failing"] and row["members"] == names[1:]
