"""Flow control end to end: a real gateway in front of real simulated replicas, the openai SDK.

The route saturates on the gateway's own in-flight count (one request per replica), so a
test saturates it by keeping one long request running — no timing is asserted, only order
and outcome (the ratio tests are in test_flow_ratios.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from gw_helpers import MODEL, chat, client, metric_sum, running_gateway, wait_for

from gateway.config import parse_config
from gateway.http.server import RunningGateway, serve_in_thread

#: saturated at one request in flight per replica; nothing scraped counts
ONE_PER_REPLICA = {
    "in_flight": 1,
    "queued_prefill_tokens": 0,
    "waiting": 0,
    "kv_cache_usage": 0,
    "scrape_stale_s": 0,
}


def flow_gateway(urls: list[str], **flow: Any) -> contextlib.AbstractContextManager[RunningGateway]:
    settings = {"enabled": True, "saturation": ONE_PER_REPLICA, "objectives": {"chat": 10, "batch": -1}, **flow}
    return running_gateway(urls, flow_control=settings)


def post(gw: RunningGateway, max_tokens: int = 1, timeout: float = 30, **headers: str) -> httpx.Response:
    body = {"model": MODEL, "messages": chat("hello there"), "max_tokens": max_tokens}
    return httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers, timeout=timeout)


def queued(gw: RunningGateway) -> int:
    return sum(f.queue.count for f in gw.gateway.flow.routes.values())


@contextlib.contextmanager
def busy(gw: RunningGateway, n: int = 1, max_tokens: int = 80) -> Iterator[list[httpx.Response]]:
    """``n`` long requests running (one per replica saturates the route); joined on exit."""
    answers: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: answers.append(post(gw, max_tokens))) for _ in range(n)]
    for t in threads:
        t.start()
    replicas = gw.gateway.replicas.values()
    wait_for(lambda: sum(r.in_flight for r in replicas) >= n, what="the long requests in flight")
    try:
        yield answers
    finally:
        for t in threads:
            t.join(30)


def sim_requests(url: str) -> float:
    return metric_sum(httpx.get(f"{url}/metrics", timeout=5).text, "vllm:request_success_total")


def test_held_while_saturated_then_placed(
    slow_sims: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="prefix_gateway.access")
    monkeypatch.setenv("PREFIX_GATEWAY_ADMIN_KEY", "admin-secret")
    with flow_gateway(slow_sims[:1]) as gw, busy(gw) as long:
        done: list[Any] = []
        t = threading.Thread(
            target=lambda: done.append(
                client(gw).chat.completions.create(model=MODEL, messages=chat("queued one"), max_tokens=1)
            )
        )
        t.start()
        wait_for(lambda: queued(gw) == 1, what="the request held in the gateway")
        assert gw.gateway.replicas["r0"].in_flight == 1  # held at the gateway, not sent
        t.join(30)
        assert done and done[0].choices[0].message.content is not None
        assert long and long[0].status_code == 200  # the long one finished first: it was placed after
        admin = {"Authorization": "Bearer admin-secret"}
        stats = httpx.get(f"{gw.url}/admin/stats", headers=admin, timeout=5).json()["flow_control"]["routes"]["main"]
        assert stats["held"] == 0 and stats["queued"] == 1 and stats["dispatched"] == 1
        text = httpx.get(f"{gw.url}/metrics", timeout=5).text
        assert metric_sum(text, "prefix_gateway_flow_requests_total", event="dispatched") == 1
        assert metric_sum(text, "prefix_gateway_flow_wait_seconds_count", route="main") == 1
    # the access log line says why it waited and where it went (one quoted field)
    access = [r.getMessage() for r in caplog.records if r.name == "prefix_gateway.access"]
    held = [line for line in access if "queued_ms=" in line]
    assert len(held) == 1
    assert 'queued="queued ' in held[0] and "behind 0 request(s) (band 0, flow route:main); placed on r0" in held[0]


def test_negative_priority_is_shed_first(slow_sims: list[str]) -> None:
    with flow_gateway(slow_sims[:1]) as gw, busy(gw):
        shed = post(gw, **{"x-llm-d-inference-objective": "batch"})
        assert shed.status_code == 429
        assert shed.json()["error"]["code"] == "flow_control_shed"
        assert int(shed.headers["retry-after"]) >= 1
        # the legacy header too, and a normal request in the same state is held, not shed
        assert post(gw, **{"x-gateway-inference-objective": "batch"}).status_code == 429
        assert post(gw, **{"x-llm-d-inference-objective": "chat"}).status_code == 200
    with flow_gateway(slow_sims[:1]) as gw:  # not saturated: sheddable traffic goes as usual
        assert post(gw, **{"x-llm-d-inference-objective": "batch"}).status_code == 200


def test_a_client_that_leaves_the_queue_never_reaches_a_replica(slow_sims: list[str]) -> None:
    url = slow_sims[1]
    before = sim_requests(url)
    with flow_gateway([url]) as gw:
        with busy(gw):
            with pytest.raises(openai.APITimeoutError):
                client(gw).with_options(timeout=0.3).chat.completions.create(
                    model=MODEL, messages=chat("gone"), max_tokens=1
                )
            wait_for(lambda: queued(gw) == 0, what="the queue to let it go")
        route = gw.gateway.flow.routes["main"]
        assert route.totals["cancelled"] == 1 and route.totals["dispatched"] == 0
        wait_for(lambda: gw.gateway.replicas["r0"].in_flight == 0, what="the long request to finish")
    assert sim_requests(url) == before + 1  # the long request only


@pytest.mark.parametrize("status", [503, 429])
def test_ttl_expiry_answers_with_retry_after(slow_sims: list[str], status: int) -> None:
    with flow_gateway(slow_sims[:1], ttl_s=0.2, expired_status=status, retry_after_s=2.5) as gw, busy(gw):
        with pytest.raises(openai.APIStatusError) as caught:
            client(gw).chat.completions.create(model=MODEL, messages=chat("late"), max_tokens=1)
        response = caught.value.response
        assert response.status_code == status
        assert response.json()["error"]["code"] == "flow_control_expired"
        assert response.headers["retry-after"] == "3" and response.headers["retry-after-ms"] == "2500"
        assert gw.gateway.flow.routes["main"].totals["expired"] == 1


def test_a_full_band_refuses_with_429(slow_sims: list[str]) -> None:
    with flow_gateway(slow_sims[:1], bands={0: {"max_requests": 1}}) as gw, busy(gw):
        held = threading.Thread(target=post, args=(gw,))
        held.start()
        wait_for(lambda: queued(gw) == 1, what="one request held")
        refused = post(gw)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "flow_control_full"
        # another band has its own bound
        assert post(gw, **{"x-llm-d-inference-objective": "chat"}).status_code == 200
        held.join(30)


def test_strict_priority_between_bands(slow_sims: list[str]) -> None:
    order: list[str] = []
    lock = threading.Lock()

    def send(name: str, objective: str | None) -> None:
        headers = {"x-llm-d-inference-objective": objective} if objective else {}
        response = post(gw, **headers)
        assert response.status_code == 200
        with lock:
            order.append(name)

    with flow_gateway(slow_sims[:1]) as gw, busy(gw):
        low = threading.Thread(target=send, args=("low", None))
        low.start()
        wait_for(lambda: queued(gw) == 1, what="the low one held")
        high = threading.Thread(target=send, args=("high", "chat"))
        high.start()
        wait_for(lambda: queued(gw) == 2, what="both held")
        low.join(30)
        high.join(30)
    assert order == ["high", "low"]


def test_turned_off_by_a_reload_lets_held_requests_go(slow_sims: list[str], tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    data = {
        "server": {"port": 0},
        "logging": {"summary_interval_s": 0},
        "replicas": [{"name": "r0", "url": slow_sims[0]}],
        "routes": [{"name": "main", "policy": "least_loaded"}],
        "flow_control": {"enabled": True, "saturation": ONE_PER_REPLICA},
    }
    path.write_text(json.dumps(data))
    with serve_in_thread(parse_config(data, "<test>"), config_path=path, reload_poll_s=0.05) as gw, busy(gw):
        answer: list[httpx.Response] = []
        t = threading.Thread(target=lambda: answer.append(post(gw)))
        t.start()
        wait_for(lambda: queued(gw) == 1, what="one request held")
        data["flow_control"] = {"enabled": False}
        path.write_text(json.dumps(data))
        wait_for(lambda: gw.gateway.reloads["ok"] == 1, what="the reload")
        wait_for(lambda: queued(gw) == 0, what="the queue to empty")
        assert not gw.gateway.flow.enabled
        # let go as a direct decision (its handler places it next) and served; not "sent next
        # to the long one" (in flight 2): on a loaded box the long one may have ended by then
        t.join(30)
        assert answer and answer[0].status_code == 200, answer
        assert answer[0].headers["x-prefix-gateway-replica"] == "r0"


def test_explain_says_what_flow_control_would_do(slow_sims: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIX_GATEWAY_ADMIN_KEY", "admin-secret")
    admin = {"Authorization": "Bearer admin-secret"}

    def explain(**headers: str) -> dict[str, Any]:
        body = {"model": MODEL, "messages": chat("hello there")}
        wrapper = {"endpoint": "chat", "body": body, "headers": headers}
        response = httpx.post(f"{gw.url}/admin/explain", json=wrapper, headers=admin, timeout=10)
        assert response.status_code == 200, response.text
        return response.json()["flow_control"]

    with flow_gateway(slow_sims[:1]) as gw:
        idle = explain()
        assert idle["would"] == "direct" and not idle["saturated"] and idle["flow"] == "route:main"
        with busy(gw):
            assert explain()["would"] == "queue"
            shed = explain(**{"x-llm-d-inference-objective": "batch", "x-llm-d-inference-fairness-id": "t9"})
            assert shed["would"] == "shed" and shed["priority"] == -1 and shed["flow"] == "id:t9"
            assert shed["replicas_full"] == {"r0": "in_flight"}


def test_a_placed_request_that_fails_before_its_send_gives_its_room_back(
    slow_sims: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Flow control counts a held request on its replica when it places it; a failure between
    that and the upstream call (here an error building the body) must not keep the slot."""
    import gateway.proxy.handler as handler
    from gateway.errors import BadRequest

    real = handler.upstream_body

    def failing(raw: bytes, *args: Any) -> Any:
        if b"doomed" in raw:
            raise BadRequest("made to fail after placement")
        return real(raw, *args)

    monkeypatch.setattr(handler, "upstream_body", failing)
    with flow_gateway(slow_sims[:1]) as gw:
        replica = gw.gateway.replicas["r0"]
        with busy(gw):
            answer: list[httpx.Response] = []
            body = {"model": MODEL, "messages": chat("doomed one"), "max_tokens": 1}
            t = threading.Thread(
                target=lambda: answer.append(httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=30))
            )
            t.start()
            wait_for(lambda: queued(gw) == 1, what="the request held")
        t.join(30)
        assert answer[0].status_code == 400
        wait_for(lambda: replica.in_flight == 0, what="its slot given back")
        assert replica.pending_prefill_tokens == 0
        assert post(gw).status_code == 200  # the route has room again: nothing waits


def test_a_fleet_whose_scrapes_all_went_stale_is_served_not_held(slow_sims: list[str]) -> None:
    """Stale engine numbers are not a full fleet: with every replica's last scrape past
    ``scrape_stale_s`` (a /metrics that broke after the first scrape; here, no scrape after
    the one at start) the gateway is blind, not saturated, and judges the replicas on its own
    counts as it does replicas it never scraped — not every request held to its TTL (503)."""
    flow = {"enabled": True, "ttl_s": 2.0, "saturation": {"scrape_stale_s": 0.2}}
    with running_gateway(slow_sims, flow_control=flow, scrape={"interval_s": 3600.0}) as gw:
        replicas = list(gw.gateway.replicas.values())
        assert all(r.engine is not None for r in replicas)  # the scrape at start
        wait_for(
            lambda: all(time.monotonic() - r.engine.scraped_at > 0.2 for r in replicas),  # type: ignore[union-attr]
            what="every scrape stale",
        )
        answer = client(gw, max_retries=0).chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=2)
        assert answer.choices[0].message.content is not None
        flows = gw.gateway.flow.routes
        assert "main" not in flows or flows["main"].totals["queued"] == 0  # placed at once, never held


def test_a_request_no_replica_holds_a_prefix_of_takes_the_first_replica_with_room(slow_sims: list[str]) -> None:
    """The affinity wait is for a prefix held somewhere: a queued request whose policy's pick
    holds none of it (round robin's turn here, a prompt nothing matched in the prefix
    policy) goes to the first replica that frees, not to that pick once it has room."""
    settings = {"enabled": True, "saturation": ONE_PER_REPLICA, "affinity_wait_s": 30}
    routes = [{"name": "main", "policy": "round_robin"}]

    def send(text: str, max_tokens: int, into: list[httpx.Response]) -> threading.Thread:
        body = {"model": MODEL, "messages": chat(text), "max_tokens": max_tokens}
        t = threading.Thread(
            target=lambda: into.append(httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=60))
        )
        t.start()
        return t

    with running_gateway(slow_sims[:2], routes=routes, flow_control=settings) as gw:
        replicas = gw.gateway.replicas
        long: list[httpx.Response] = []
        short: list[httpx.Response] = []
        threads = [send("a long answer please", 150, long)]
        wait_for(lambda: sum(r.in_flight for r in replicas.values()) == 1, what="one replica busy")
        busy_long = next(name for name, r in replicas.items() if r.in_flight)
        threads.append(send("a short answer please", 20, short))
        wait_for(lambda: all(r.in_flight for r in replicas.values()), what="both replicas busy")
        answer: list[httpx.Response] = []
        threads.append(send("a question for whoever is free", 1, answer))  # round robin's turn: busy_long
        wait_for(lambda: answer or queued(gw) == 1, what="the request held")
        threads[-1].join(30)
        assert answer and answer[0].status_code == 200
        assert answer[0].headers["x-prefix-gateway-replica"] != busy_long  # the first to free
        assert not long  # ... long before the turn's replica had room
        for t in threads:
            t.join(60)
