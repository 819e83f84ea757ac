"""Alignment from the engine itself, end to end: simulated replicas (in-process servers on
127.0.0.1) with their own tokenizer, template and ``--block-size``; the gateway with its default
prefix settings in front; the official openai SDK as client.

- the route follows the replicas' published block size (``vllm:cache_config_info``), so its
  predicted cached tokens equal what the replicas report, and says ``exact (llama3)``; with a
  hand-set block size that contradicts them it says which does not match;
- replicas that disagree on the block size are named in /admin/stats, explain and the doctor;
- ``cache_salt``, a LoRA adapter as ``model``, ``session_id`` / ``X-Session-ID`` and
  ``X-Vllm-Priority`` reach the replica unchanged, and are keyed as the engine isolates them.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from e2e_helpers import ADMIN_KEY, admin, client, gateway, wait_for

from gateway.doctor import diagnose, to_dict
from gateway.doctor.sources import from_gateway
from gateway.http.server import RunningGateway
from gateway.sim.app import create_app
from gateway.sim.options import build_options
from gateway.sim.server import serve_in_thread as sim_in_thread

LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
SIM = {
    "model": LLAMA,
    "tokenizer": "llama3",
    "time_scale": 0,
    "num_gpu_blocks": 2048,
    "max_output_tokens": 4,
    "disable_log_stats": True,
}
ROUTE = {"name": "main", "match": {"models": [LLAMA, "sql-lora"]}, "policy": "prefix"}  # prefix settings: defaults


@pytest.fixture(autouse=True)
def _admin_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIX_GATEWAY_ADMIN_KEY", ADMIN_KEY)


@contextlib.contextmanager
def sims(*block_sizes: int, **options: Any) -> Iterator[list[str]]:
    """One in-process simulated replica per block size."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(sim_in_thread({**SIM, **options}, block_size=bs)) for bs in block_sizes]


def route_stats(gw: RunningGateway) -> dict[str, Any]:
    with admin(gw, ADMIN_KEY) as api:
        return api.get("/admin/stats").json()["routes"]["main"]


def system_prompt(topic: str, words: int) -> str:
    return f"You answer questions about {topic}. " + " ".join(f"{topic}{i % 97}" for i in range(words))


def ask_twice(gw: RunningGateway, topics: list[str]) -> list[tuple[int, int]]:
    """Each topic's prompt twice (the second is a prefix hit); (predicted, reported) per request."""
    sdk = client(gw)
    tally = gw.gateway.stats
    out = []
    for topic in topics:
        messages = [{"role": "system", "content": system_prompt(topic, 700)}, {"role": "user", "content": "Hi?"}]
        for _ in range(2):
            before = tally.by_route.get("main")
            n = before.predicted_requests if before else 0
            predicted0 = before.predicted_cached_tokens if before else 0
            reply = sdk.chat.completions.create(model=LLAMA, messages=messages, max_tokens=4)
            after = wait_for(
                lambda n=n: (t := tally.by_route.get("main")) is not None and t.predicted_requests > n and t,
                what="the request recorded",
            )
            details = reply.usage.prompt_tokens_details if reply.usage else None
            assert details is not None and details.cached_tokens is not None
            out.append((after.predicted_cached_tokens - predicted0, details.cached_tokens))
    return out


def test_the_route_follows_the_engines_block_size_and_labels_exactness() -> None:
    with sims(128, 128) as urls:
        with gateway(urls, routes=[ROUTE]) as gw:
            view = route_stats(gw)
            block = view["block_size"]
            assert (block["size"], block["setting"], block["source"]) == (128, "auto", "engines")
            assert block["engines"] == {"r0": 128, "r1": 128} and not block["disagree"]
            pairs = ask_twice(gw, ["tides", "moss", "gears"])
            view = route_stats(gw)
        assert [p for p, _ in pairs] == [r for _, r in pairs], pairs  # every prediction is what was reported
        assert any(r >= 128 for _, r in pairs) and all(r % 128 == 0 for _, r in pairs)
        assert view["predicted_units"] == "exact (llama3)" and view["predicted_exact"] is True
        assert view["hit_rate_gap"] == 0

        # the same fleet, the block size set by hand to vLLM's GPU default: the keys are not the
        # engines' (said so), the predictions cut to the engines' whole 128-token blocks
        fixed = {**ROUTE, "prefix": {"block_size": 16}}
        with gateway(urls, routes=[fixed]) as gw:
            pairs = ask_twice(gw, ["lichen", "ferns", "anvils"])
            view = route_stats(gw)
            assert view["block_size"]["source"] == "config" and view["block_size"]["mismatched"] == ["r0", "r1"]
        assert [p for p, _ in pairs] == [r for _, r in pairs] and any(r >= 128 for _, r in pairs)
        assert view["predicted_units"] == "approximate (llama3): block size 16 vs engine 128"
        assert view["predicted_exact"] is False


def predicted_and_reported(gw: RunningGateway, messages: list[dict[str, str]]) -> tuple[int, int, int]:
    """One request: (predicted cached tokens, reported cached tokens, reported prompt tokens)."""
    tally = gw.gateway.stats
    before = tally.by_route.get("main")
    n, predicted0 = (before.predicted_requests, before.predicted_cached_tokens) if before else (0, 0)
    reply = client(gw).chat.completions.create(model=LLAMA, messages=messages, max_tokens=4)  # type: ignore[arg-type]
    after = wait_for(
        lambda: (t := tally.by_route.get("main")) is not None and t.predicted_requests > n and t,
        what="the request recorded",
    )
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    cached = reply.usage.prompt_tokens_details.cached_tokens or 0
    return after.predicted_cached_tokens - predicted0, cached, reply.usage.prompt_tokens


def test_past_the_window_the_next_turn_is_predicted_from_the_last_replys_prompt_tokens() -> None:
    """Past the token window the gateway only estimates tokens from text bytes, at the window's
    ratio; digits run at another.  The reply's usage.prompt_tokens is exact: the next turn,
    which holds the last prompt's final key, is predicted to the token the engine reports."""
    digits = ",".join(str(i * 7919 % 1000) for i in range(2500))  # ~2 bytes per token, the window ~5
    first = [{"role": "system", "content": system_prompt("tides", 400)}, {"role": "user", "content": digits}]
    second = [*first, {"role": "assistant", "content": "Noted."}, {"role": "user", "content": "Sum them."}]
    seen = {}
    with sims(16, 16) as urls:
        for anchors in (100_000, 0):  # the default, and turned off
            route = {**ROUTE, "prefix": {"window_tokens": 256, "prompt_anchors": anchors}}
            with gateway(urls, routes=[route]) as gw:  # each run its own conversation (a new head)
                _, cached, prompt = predicted_and_reported(gw, [{"role": "system", "content": str(anchors)}, *first])
                assert cached < 64 and prompt > 2000  # at most the template's preamble
                predicted, cached, _ = predicted_and_reported(
                    gw, [{"role": "system", "content": str(anchors)}, *second]
                )
                assert cached == prompt // 16 * 16  # the engine holds the whole first prompt
                seen[anchors] = predicted, cached
    assert seen[100_000][0] == seen[100_000][1]  # the gateway knows how many tokens that is
    assert seen[0][0] < seen[0][1] - 500  # without the reply's count: the window's ratio, far short


def test_replicas_that_disagree_are_named_in_stats_explain_and_doctor() -> None:
    with sims(128, 16, 128) as urls, gateway(urls, routes=[ROUTE]) as gw:
        block = route_stats(gw)["block_size"]
        assert block["engines"] == {"r0": 128, "r1": 16, "r2": 128}
        # the route hashes the size every engine's is a multiple of (16), not the most common (128)
        assert block["disagree"] and block["size"] == 16 and block["mismatched"] == ["r0", "r2"]
        assert "16: r1; 128: r0, r2" in block["note"]
        sdk = client(gw)
        # new prompts are placed by load: soon on r1 (at the route's 16) and on a replica at 128;
        # each asked twice, so the second is a hit to predict
        for i in range(12):
            messages = [{"role": "user", "content": system_prompt(f"kelp{i}", 300)}]
            for _ in range(2):
                sdk.chat.completions.create(model=LLAMA, messages=messages, max_tokens=4)  # type: ignore[arg-type]
            view = wait_for(
                lambda n=i: (v := route_stats(gw)).get("predicted_requests", 0) > 2 * n + 1 and v, what="it"
            )
            served = {name for name, row in view["replicas"].items() if row.get("predicted_requests")}
            if "r1" in served and served & {"r0", "r2"}:
                break
        units = {name: row.get("predicted_units") for name, row in view["replicas"].items()}
        # each prediction is labelled for the engine it went to: r0's and r2's blocks are not the keys'
        assert units["r1"] == "exact (llama3)"
        assert {units[name] for name in ("r0", "r2") if units.get(name)} == {
            "approximate (llama3): block size 16 vs engine 128"
        }
        assert view["predicted_units"].startswith("mixed: ") and view["predicted_exact"] is False
        # ... and every prediction is what the engine reported: r1 to its 16s, r0 and r2 cut to
        # their whole 128s (with the most common size, r1's hits were cut to 128s: under by up to 112)
        errors = {name: row.get("prediction_error") for name, row in view["replicas"].items() if name in served}
        assert errors and set(errors.values()) == {0}, errors
        with admin(gw, ADMIN_KEY) as api:
            explained = api.post(
                "/admin/explain", json={"model": LLAMA, "messages": [{"role": "user", "content": "hello"}]}
            ).json()
        prefix = explained["prefix"]
        assert prefix["block_size"] == 16 and prefix["block_size_source"] == "engines"
        assert prefix["engine_block_sizes"] == {"r0": 128, "r1": 16, "r2": 128}
        assert "16: r1" in prefix["block_size_note"]
        assert prefix["units"] == "approximate (llama3): block size 16 vs engine 128"
        report = to_dict(diagnose(from_gateway(gw.url, ADMIN_KEY)))
        found = [f for f in report["findings"] if f["cause"] == "tokenizer_mismatch"]
        assert found, report["findings"]
        assert found[0]["data"]["disagree"] is True and found[0]["data"]["engines"] == block["engines"]
        assert any("16 on r1" in line and "128 on r0, r2" in line for line in found[0]["evidence"])


# -- item 5: what the replica receives, and how it is keyed ------------------------------------------
class Recorder:
    """An ASGI wrapper around a simulated replica that keeps what each /v1 request carried."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.options = app.options
        self.seen: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/chat"):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []

        async def recording_receive() -> Any:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                with self._lock:
                    self.seen.append(
                        {
                            "headers": {k.decode().lower(): v.decode() for k, v in scope["headers"]},
                            "body": json.loads(b"".join(chunks)),
                        }
                    )
            return message

        await self.app(scope, recording_receive, send)


@contextlib.contextmanager
def recording_sim(**options: Any) -> Iterator[tuple[str, Recorder]]:
    import socket
    import time

    import uvicorn

    from gateway.sim.server import uvicorn_config

    recorder = Recorder(create_app(build_options({**SIM, **options})))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn_config(recorder, own_process=False))  # type: ignore[arg-type]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the recording replica did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", recorder
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_salt_lora_session_and_priority_pass_through_unchanged_and_key_like_the_engine() -> None:
    document = system_prompt("ledgers", 400)
    messages = [{"role": "system", "content": document}, {"role": "user", "content": "Sum it up."}]
    with (
        recording_sim(lora_modules=["sql-lora"], block_size=16) as (url, recorder),
        gateway([url], routes=[ROUTE]) as gw,
    ):
        sdk = client(gw)
        raw = sdk.chat.completions.with_raw_response.create(
            model="sql-lora",
            messages=messages,
            max_tokens=4,
            extra_body={"cache_salt": "tenant-a", "session_id": "sess-42", "priority": 3},
            extra_headers={"X-Session-ID": "sess-42", "X-Vllm-Priority": "7"},
        )
        assert raw.parse().model == "sql-lora"
        got = recorder.seen[-1]
        assert got["body"]["model"] == "sql-lora"
        assert (got["body"]["cache_salt"], got["body"]["session_id"], got["body"]["priority"]) == (
            "tenant-a",
            "sess-42",
            3,
        )
        assert got["body"]["messages"] == messages
        assert got["headers"]["x-session-id"] == "sess-42" and got["headers"]["x-vllm-priority"] == "7"

        def explain(model: str, salt: str | None) -> dict[str, Any]:
            body: dict[str, Any] = {"model": model, "messages": messages}
            if salt is not None:
                body["cache_salt"] = salt
            with admin(gw, ADMIN_KEY) as api:
                return api.post("/admin/explain", json=body).json()

        lora_a, lora_b, base_a = (
            explain("sql-lora", "tenant-a"),
            explain("sql-lora", "tenant-b"),
            explain(LLAMA, "tenant-a"),
        )
        assert (lora_a["prefix"]["lora"], lora_a["prefix"]["base_model"]) == ("sql-lora", LLAMA)
        assert base_a["prefix"]["lora"] is None
        assert lora_a["prefix"]["units"] == base_a["prefix"]["units"] == "exact (llama3)"  # the base's tokenizer
        # the request above is cached for (sql-lora, tenant-a) only: predicted there, nowhere else
        assert lora_a["decision"]["predicted_cached_tokens"] > 0
        assert lora_b["decision"]["predicted_cached_tokens"] == 0
        assert base_a["decision"]["predicted_cached_tokens"] == 0

        # and the replica agrees: the same three requests, what it reports cached
        def cached(model: str, salt: str) -> int:
            reply = sdk.chat.completions.create(
                model=model, messages=messages, max_tokens=4, extra_body={"cache_salt": salt}
            )
            assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
            return reply.usage.prompt_tokens_details.cached_tokens or 0

        assert cached("sql-lora", "tenant-a") == lora_a["decision"]["predicted_cached_tokens"]
        assert cached("sql-lora", "tenant-b") == 0
        assert cached(LLAMA, "tenant-a") == 0


def test_a_route_that_forwards_priority_replaces_the_clients_x_vllm_priority() -> None:
    """``flow_control.forward_priority``: the replica gets the gateway's priority, negated (vLLM
    runs lower first), from the objective header's mapping — not the value the client sent."""
    route = {**ROUTE, "flow_control": {"forward_priority": True}}
    flow = {"objectives": {"interactive": 10}}
    with recording_sim(block_size=16) as (url, recorder), gateway([url], routes=[route], flow_control=flow) as gw:
        sdk = client(gw)
        messages = [{"role": "user", "content": "Which ledger?"}]
        sdk.chat.completions.create(
            model=LLAMA,
            messages=messages,
            max_tokens=2,
            extra_headers={"X-Vllm-Priority": "7", "x-llm-d-inference-objective": "interactive"},
        )
        assert recorder.seen[-1]["headers"]["x-vllm-priority"] == "-10"
        plain = {"X-Vllm-Priority": "7"}
        sdk.chat.completions.create(model=LLAMA, messages=messages, max_tokens=2, extra_headers=plain)
        assert recorder.seen[-1]["headers"]["x-vllm-priority"] == "0"  # no objective: the default, 0
