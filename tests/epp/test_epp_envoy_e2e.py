"""End to end with a real Envoy on loopback: the openai SDK → Envoy → (ext_proc: the picker) → 4 simulated replicas."""

from __future__ import annotations

import itertools
import json
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.config import GatewayConfig, sha256_hex
from gateway.sim.launcher import ReplicaGroup
from tests.configs import gateway_config
from tests.epp.envoy_harness import envoy, metrics_url, need_envoy, picker
from tests.polling import wait_for

pytestmark = pytest.mark.slow  # a real Envoy and a picker per test: seconds each

MODEL = "demo-model"
ADMIN_KEY = "epp-admin-key"


@pytest.fixture(autouse=True)
def _envoy_installed() -> None:
    need_envoy()


def picker_config(urls: list[str], **overrides: Any) -> GatewayConfig:
    route = {"name": "main", "match": {"models": [MODEL]}, "policy": "prefix", "normalize": {"mode": "relocate"}}
    overrides.setdefault("routes", [route])
    return gateway_config(urls, admin={"api_key_sha256": sha256_hex(ADMIN_KEY)}, **overrides)


def test_chat_completions_embeddings_and_models_through_envoy(fleet: ReplicaGroup, tmp_path: Path) -> None:
    with picker(picker_config(fleet.urls)) as pk, envoy(fleet.urls, pk.grpc_port, tmp_path) as ev:
        client = ev.client()
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "Hello through Envoy"}], max_tokens=4
        )
        reply = raw.parse()
        assert reply.choices[0].message.content and reply.usage.prompt_tokens > 0
        assert raw.headers["x-prefix-gateway-route"] == "main"
        assert raw.headers["x-prefix-gateway-replica"] in {"r0", "r1", "r2", "r3"}
        assert "x-gateway-destination-endpoint-served" not in raw.headers  # the data plane's, not the client's

        chunks = list(
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Stream it"}], max_tokens=4, stream=True
            )
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert all(c.usage is None for c in chunks)  # the picker's include_usage is taken out again

        completion = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4)
        assert completion.choices[0].text
        streamed = list(client.completions.create(model=MODEL, prompt="Once upon", max_tokens=4, stream=True))
        assert any(c.choices and c.choices[0].text for c in streamed)

        embedding = client.embeddings.create(model=MODEL, input="embed me")
        assert len(embedding.data[0].embedding) > 0

        big = "lorem " * 25_000  # 150 KB: several streamed chunks each way, mutations under 64 KiB
        long = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": big}], max_tokens=2)
        assert long.usage.prompt_tokens > 20_000

        models = client.models.list()
        assert [m.id for m in models.data] == [MODEL]  # answered by the picker: the fleet's union

        stats = httpx.get(
            metrics_url(pk) + "/admin/stats", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10
        ).json()
        main = stats["routes"]["main"]
        assert main["requests"] == 6 and main["errors"] == 0  # models is not an inference request


def test_bad_input_gets_openai_shaped_errors_through_envoy(fleet: ReplicaGroup, tmp_path: Path) -> None:
    config = picker_config(fleet.urls, server={"max_body_bytes": 4096})
    with picker(config) as pk, envoy(fleet.urls, pk.grpc_port, tmp_path) as ev:
        url = ev.url + "/v1/chat/completions"
        cases = [
            (b"this is not json", 400, "invalid_json"),
            (json.dumps({"model": MODEL}).encode(), 400, "missing_required_parameter"),
            (json.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]}).encode(), 404, None),
            (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 8000}]}).encode(), 413, None),
        ]
        for body, status, code in cases:
            response = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=10)
            assert response.status_code == status, response.text
            error = response.json()["error"]
            assert set(error) >= {"message", "type", "code"}
            if code is not None:
                assert error["code"] == code
        # a client that goes away mid-stream: the picker releases the replica, nothing hangs
        with httpx.stream(
            "POST",
            url,
            json={"model": MODEL, "messages": [{"role": "user", "content": "cut me"}], "stream": True, "max_tokens": 8},
            timeout=10,
        ) as stream:
            next(stream.iter_bytes())
        wait_for(lambda: all(r.in_flight == 0 for r in pk.gateway.replicas.values()), 10, what="replicas released")
        ok = httpx.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": "still up"}]}, timeout=10)
        assert ok.status_code == 200


SYSTEM = "You are a meticulous travel agent. " + "Answer with care and cite the rules of the fare. " * 200


def conversation(client: Any, n: int, turns: int) -> list[str]:
    messages = [{"role": "system", "content": SYSTEM}]
    replicas = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Traveller {n}, question {turn}: which seat is best?"})
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=4)
        replicas.append(raw.headers["x-prefix-gateway-replica"])
        messages.append({"role": "assistant", "content": raw.parse().choices[0].message.content})
    return replicas


def test_conversations_behind_a_shared_prompt_keep_their_replica_and_hit_rates_show(
    fleet: ReplicaGroup, tmp_path: Path
) -> None:
    with picker(picker_config(fleet.urls)) as pk, envoy(fleet.urls, pk.grpc_port, tmp_path) as ev:
        client = ev.client()
        conversation(client, -1, 1)  # the shared system prompt is placed first
        with ThreadPoolExecutor(16) as pool:
            paths = list(pool.map(lambda n: conversation(ev.client(), n, 6), range(16)))
        kept = sum(a == b for path in paths for a, b in itertools.pairwise(path))
        turns = sum(len(path) - 1 for path in paths)
        assert kept / turns >= 0.95, paths
        text = httpx.get(metrics_url(pk) + "/metrics", timeout=10).text
        assert 'prefix_gateway_cached_tokens_total{replica="' in text
        assert "prefix_gateway_predicted_cached_tokens_total" in text
        stats = httpx.get(
            metrics_url(pk) + "/admin/stats", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10
        ).json()["routes"]["main"]
        assert stats["hit_rate_reported"] is not None and stats["hit_rate_reported"] > 0.5, stats
        assert stats["hit_rate_predicted"] is not None and stats["hit_rate_predicted"] > 0.5, stats


def test_a_normalized_body_reaches_the_replica_rewritten(echo_url: str, tmp_path: Path) -> None:
    route = {
        "name": "main",
        "match": {"models": [MODEL]},
        "policy": "prefix",
        "normalize": {"mode": "relocate", "always": ["*"]},
    }
    with picker(picker_config([echo_url], routes=[route])) as pk, envoy([echo_url], pk.grpc_port, tmp_path) as ev:
        messages = [
            {"role": "system", "content": "Current date and time: 2025-03-04T09:05:17Z.\nYou are helpful."},
            {"role": "user", "content": "When do you open?"},
        ]
        raw = ev.client().chat.completions.with_raw_response.create(model=MODEL, messages=messages)
        forwarded = raw.http_response.json()["echo"]["body"]["messages"]
    assert "2025-03-04T09:05:17Z" not in forwarded[0]["content"]
    assert forwarded[0]["content"].startswith("Current date and time: {{volatile:iso_datetime:1}}.")
    assert "2025-03-04T09:05:17Z" in forwarded[1]["content"]  # the model still gets the value
    assert raw.headers["x-prefix-gateway-normalized"] == "iso_datetime=1"


@pytest.mark.parametrize("fail_open", [True, False])
def test_with_the_picker_down_envoy_follows_its_failure_mode(
    fleet: ReplicaGroup, tmp_path: Path, fail_open: bool
) -> None:
    from gateway.sim.launcher import free_port

    nobody = free_port()  # no picker listens here
    with envoy(fleet.urls, nobody, tmp_path, fail_open=fail_open, wait_picker=False) as ev:
        wait_for(ev.picker_failed, 20, what="envoy's health check to find the picker down")
        response = httpx.post(
            ev.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "is anyone there?"}], "max_tokens": 4},
            timeout=15,
        )
    if fail_open:  # the request still reaches a replica (override_host's round-robin fallback)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"]
    else:  # fail-closed: refused, nothing reached a replica
        assert response.status_code >= 500, response.text
    served = sum(served_requests(url) for url in fleet.urls)
    assert served == (1 if fail_open else 0)


def served_requests(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "vllm:request_success_total"
    )


def test_a_replica_killed_under_load_fails_no_non_streaming_request(fleet: ReplicaGroup, tmp_path: Path) -> None:
    with picker(picker_config(fleet.urls)) as pk, envoy(fleet.urls, pk.grpc_port, tmp_path) as ev:
        failures: list[str] = []
        done = [0]
        stop = threading.Event()

        def load(worker: int) -> None:
            client = ev.client()
            i = 0
            while not stop.is_set():
                i += 1
                try:
                    client.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": f"worker {worker} request {i}"}],
                        max_tokens=4,
                    )
                    done[0] += 1
                except Exception as exc:  # any failure counts
                    failures.append(f"{type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=load, args=(w,), daemon=True) for w in range(8)]
        for thread in threads:
            thread.start()
        wait_for(lambda: done[0] >= 40, 30, what="load running")
        fleet.replicas[1].signal(signal.SIGKILL)  # killed mid-load
        before = done[0]
        wait_for(lambda: done[0] >= before + 150, 60, what="load continuing past the kill")
        stop.set()
        for thread in threads:
            thread.join(30)
        assert not failures, failures[:5]
        stats = pk.gateway.stats.by_route["main"]
        assert stats.errors == 0


def test_a_dead_pick_is_retried_on_a_fallback_and_routing_learns_who_served(
    fleet: ReplicaGroup, tmp_path: Path
) -> None:
    from gateway.sim.launcher import free_port

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: every connection is refused
    urls = [dead, *fleet.urls[:3]]
    # the picker believes the dead replica healthy (no probe before the test ends), so it picks it
    health = {"interval_s": 600, "unhealthy_threshold": 10, "failure_rate_percent": 100, "max_ejected_percent": 0}
    with picker(picker_config(urls, health=health)) as pk, envoy(urls, pk.grpc_port, tmp_path) as ev:
        client = ev.client()
        for i in range(24):
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": f"prompt number {i} " * 20}], max_tokens=2
            )
            assert raw.headers["x-prefix-gateway-replica"] != "r0"  # the replica that served, never the dead one
        text = httpx.get(metrics_url(pk) + "/metrics", timeout=10).text
        retried = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("prefix_gateway_retries_total")
        )
        assert retried >= 1  # some picks were the dead replica: Envoy went down the picker's list
        assert pk.gateway.replicas["r0"].in_flight == 0
        stats = pk.gateway.stats.by_route_replica
        assert ("main", "r0") not in stats or stats[("main", "r0")].requests == 0
        assert sum(t.requests for (route, _), t in stats.items() if route == "main") == 24


def test_a_saturated_route_holds_the_pick_through_envoy(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """Flow control in picker mode: Envoy waits for the held pick, which goes once the replica frees."""
    from tests.replica_fleet import shared_group

    one_per_replica = {"in_flight": 1, "queued_prefill_tokens": 0, "waiting": 0, "kv_cache_usage": 0}
    options = {"time_scale": 1.0, "decode_ms_per_token": 10.0, "max_output_tokens": 200}
    with shared_group(tmp_path_factory, "epp-slow-sim", 1, **options) as group:
        config = picker_config(group.urls, flow_control={"enabled": True, "saturation": one_per_replica})
        with picker(config) as pk, envoy(group.urls, pk.grpc_port, tmp_path) as ev:
            client = ev.client()
            done: list[tuple[str, Any]] = []

            def ask(name: str, max_tokens: int) -> None:
                messages = [{"role": "user", "content": f"{name} request"}]
                reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens)
                done.append((name, reply))

            replica = pk.gateway.replicas["r0"]
            long = threading.Thread(target=ask, args=("long", 100))
            long.start()
            wait_for(lambda: replica.in_flight == 1, what="the long request on the replica")
            held = threading.Thread(target=ask, args=("held", 2))
            held.start()
            flows = pk.gateway.flow.routes
            wait_for(lambda: sum(f.queue.count for f in flows.values()) == 1, what="the pick held at the picker")
            assert replica.in_flight == 1  # Envoy holds the request: nothing reached the replica
            long.join(30)
            held.join(30)
            assert [name for name, _ in done] == ["long", "held"]  # placed once the long one ended
            assert all(reply.choices[0].message.content is not None for _, reply in done)
            stats = httpx.get(
                metrics_url(pk) + "/admin/stats", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10
            ).json()
            main = stats["flow_control"]["routes"]["main"]
            assert main["queued"] == 1 and main["dispatched"] == 1 and main["held"] == 0
            assert replica.in_flight == 0
