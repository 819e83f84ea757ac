"""``replica_cache_tokens: auto``: the gateway sizes each replica's modelled prefix cache from
the engine's own scrape (vllm:cache_config_info), so it stops predicting prefixes the engine
evicted — and a gateway without the model, in the same run, keeps predicting them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from e2e_helpers import ADMIN_KEY, SIM_OPTIONS, admin, ask, client, gateway, prefix_route, wait_for

from gateway.sim.launcher import ReplicaGroup
from tests.replica_fleet import fresh, shared_group

BLOCKS = 64  # 1,024 tokens of KV per replica: three of the prompts below


def prompt(i: int) -> list[dict[str, str]]:
    """~300 tokens, different from the first word on: no two share a block."""
    words = " ".join(f"item{i}-{j}" for j in range(100))
    return [{"role": "user", "content": f"Request {i}: summarise {words}"}]


def modelled(gw_admin: object) -> dict[str, dict[str, int | None]]:
    stats = gw_admin.get("/admin/stats").json()  # type: ignore[attr-defined]
    return stats["routes"]["main"]["policy_state"]["affinity"]["modelled_cache_tokens"]


@pytest.fixture(scope="module")
def small_fleet_processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaGroup]:
    with shared_group(tmp_path_factory, "small-sims", 4, **{**SIM_OPTIONS, "num_gpu_blocks": BLOCKS}) as group:
        yield group


@pytest.fixture
def small_fleet(small_fleet_processes: ReplicaGroup) -> ReplicaGroup:
    """Four replicas of BLOCKS blocks each, as just started (empty caches, zeroed counters)."""
    return fresh(small_fleet_processes)


@pytest.mark.parametrize("setting", ["auto", None])
@pytest.mark.slow
def test_predictions_follow_the_engines_evictions(
    setting: str | None, small_fleet: ReplicaGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFIX_GATEWAY_ADMIN_KEY", ADMIN_KEY)
    route = prefix_route("main", "report", policy_settings={"replica_cache_tokens": setting})
    with gateway(small_fleet.urls, routes=[route]) as gw, admin(gw) as api:
        sdk = client(gw)
        if setting == "auto":  # the first scrape of each replica sizes its model
            sizes = wait_for(lambda: len(modelled(api)) == 4 and modelled(api), what="every replica's KV size")
            assert {s["capacity"] for s in sizes.values()} == {BLOCKS * 16}
        else:
            assert modelled(api) == {}
        first = [ask(sdk, prompt(i)) for i in range(24)]  # ~6 per replica: twice what each holds
        assert all(r.cached_tokens == 0 for r in first)
        again = [ask(sdk, prompt(i)) for i in range(3)]
        assert all(r.cached_tokens == 0 for r in again), "the engines evicted the oldest prompts"
        stats = api.get("/admin/stats").json()["routes"]["main"]
        held = modelled(api)
        exposed = api.get("/metrics").text  # the same model, for Prometheus
    for name, h in held.items():
        for kind in ("capacity", "held"):
            line = f'prefix_gateway_kv_model_tokens{{kind="{kind}",replica="{name}",route="main"}} {float(h[kind])}'
            assert line in exposed, line
    if setting is None:
        assert "prefix_gateway_kv_model_tokens{" not in exposed
    predicted_again = stats["predicted_cached_tokens"]
    if setting == "auto":
        assert predicted_again == 0, "the model evicted them too"
        assert all(0 < h["held"] <= BLOCKS * 16 for h in held.values())
    else:
        assert predicted_again > 0, "without the model the index still credits them"
