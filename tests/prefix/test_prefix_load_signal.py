"""Queued prefill work as the prefix policy's load signal, and cached tokens past the window.

In-flight counts are dominated by decoding requests, while a new request's time to first
token is the prefill work queued ahead of it plus its own uncached tokens.  The gateway
counts, per replica, the uncached prompt tokens of requests that have no first byte yet
(``pending_prefill_tokens``); these tests pin down how the policy uses that, and how it
estimates what a replica holds past the keyed window.
"""

from __future__ import annotations

from gateway.prefix.pipeline import PrefixPipeline
from gateway.prefix.settings import NormalizeSettings, PrefixSettings
from gateway.routing.affinity import AffinityIndex
from gateway.routing.base import ReplicaView, RequestView
from gateway.routing.policies.prefix import PrefixPolicy, PrefixPolicySettings
from gateway.tokens.tokenizer import get_tokenizer
from tests.prefix.policy_helpers import NAMES, chain, policy


def req(keys: tuple[int, ...], total: int | None = None) -> RequestView:
    window = len(keys) * 16
    return RequestView("x", "route", "m", "completions", None, keys, 16, window, total or window)


def views(pending: dict[str, int] | None = None, loads: dict[str, int] | None = None) -> list[ReplicaView]:
    pending, loads = pending or {}, loads or {}
    return [ReplicaView(n, in_flight=loads.get(n, 0), pending_prefill_tokens=pending.get(n, 0)) for n in NAMES]


def test_without_affinity_the_least_queued_prefill_wins_over_fewer_requests() -> None:
    # r0 has one request more in flight, but all of them are decoding; each of the others
    # has a long prompt waiting for its prefill.
    pending = {"r1": 9_000, "r2": 9_000, "r3": 9_000}
    loads = {"r0": 3, "r1": 2, "r2": 2, "r3": 2}
    assert policy().choose(req(chain(20, 1)), views(pending, loads)).replica == "r0"
    # ... while weight 0 is the old behaviour: fewest requests in flight.
    assert policy(prefill_queue_weight=0).choose(req(chain(20, 2)), views(pending, loads)).replica != "r0"


def test_queued_prefill_never_pulls_a_request_from_more_of_its_prompt() -> None:
    """Queued work chooses among equally good caches; a cache advantage is left to the load bound."""
    p = policy()
    head = chain(8, 3)  # 128 tokens of this prompt cached on r2 only: an earlier prompt ended there
    p.index.record("r2", head)
    d = p.peek(req(head + chain(30, 5)), views({"r2": 50_000}))
    assert d.replica == "r2" and d.reason == "affinity"
    # the same prefix cached everywhere: now the shortest queue wins
    for name in ("r0", "r1", "r3"):
        p.index.record(name, head + chain(4, 4))
    d = p.peek(req(head + chain(30, 6)), views({"r2": 50_000, "r0": 900, "r1": 800, "r3": 700}))
    assert d.replica == "r3"


def test_a_busy_shared_prefix_is_replicated_not_piled_on() -> None:
    """A prefix other prompts went on from differently (a system prompt) goes where the wait is shortest."""
    head = chain(600, 3)  # a 9,600-token system prompt, cached on r2 inside two other conversations

    def holder(**kw: object) -> PrefixPolicy:
        p = policy(**({"shared_prefix_slack": 0.0} | kw))  # replication on (off by default)
        p.index.record("r2", head + chain(4, 4))
        p.index.record("r2", head + chain(4, 7))  # a second continuation: the head is a fork
        return p

    p = holder()
    idle = p.peek(req(head + chain(30, 5)), views())
    assert idle.replica == "r2" and idle.reason == "affinity"  # an idle holder keeps it
    busy = p.peek(req(head + chain(30, 5)), views({"r2": 12_000}, {"r2": 1}))
    assert busy.replica != "r2" and busy.reason == "spill"  # computes the head elsewhere
    # a tolerance (in requests x load_cost_tokens) keeps it on the holder
    assert (
        holder(shared_prefix_slack=200).peek(req(head + chain(30, 5)), views({"r2": 12_000}, {"r2": 1})).replica == "r2"
    )
    # the request's own time to first token: waiting 12,000 queued tokens beats computing 9,600 + 480
    # elsewhere?  No: 12,064 > 10,080, so it moves; with 8,000 queued it stays
    ttft = holder(shared_recompute_weight=1.0)
    assert ttft.peek(req(head + chain(30, 5)), views({"r2": 12_000}, {"r2": 1})).replica != "r2"
    assert ttft.peek(req(head + chain(30, 5)), views({"r2": 8_000}, {"r2": 1})).replica == "r2"
    # off (null): scored like any other request, the deep match wins
    assert (
        holder(shared_prefix_slack=None).peek(req(head + chain(30, 5)), views({"r2": 12_000}, {"r2": 1})).replica
        == "r2"
    )
    # only one continuation seen: that is one conversation's history, it stays home however busy
    one = policy()
    one.index.record("r2", head + chain(4, 4))
    assert one.peek(req(head + chain(30, 5)), views({"r2": 12_000}, {"r2": 1})).replica == "r2"


def test_a_long_cached_history_stays_home_despite_queued_prefill() -> None:
    """Moving a conversation recomputes its history: queued prefill does not move it."""
    p = policy(load_factor=1.25, bound_extra=2, bound_extra_min_tokens=2048)
    history = chain(200, 7)  # 3,200 tokens >= bound_extra_min_tokens (2,048)
    p.index.record("r1", history)
    d = p.choose(req(history + chain(10, 8)), views({"r1": 20_000}))
    assert d.replica == "r1" and d.reason == "affinity"
    # ... it still moves when the replica is over its load bound
    d = p.choose(req(history + chain(10, 9)), views({"r1": 20_000}, {"r1": 4, "r0": 1}))
    assert d.replica != "r1" and d.reason == "spill"


def test_when_the_home_is_over_its_bound_queued_prefill_picks_the_next_replica() -> None:
    # (the bound always spills: with nothing queued on r1, spill_min_saving would keep it there)
    p = policy(load_factor=1.25, bound_extra=2, bound_extra_min_tokens=2048, spill_min_saving=None)
    history = chain(200, 21)  # 3,200 cached tokens on r1
    p.index.record("r1", history)
    # r1 is over its bound (ceil(1.25 x 8 / 4) + 2 = 5): the request moves, and the replica
    # with nothing queued wins over the one with a long prefill queue.
    pending = {"r0": 30_000, "r2": 0, "r3": 30_000}
    loads = {"r1": 5, "r0": 1, "r2": 1, "r3": 0}
    d = p.choose(req(history + chain(10, 22)), views(pending, loads))
    assert d.replica == "r2" and d.reason == "spill"


def test_weights_scale_queued_prefill() -> None:
    members = [ReplicaView("big", weight=4.0), ReplicaView("small", weight=1.0)]
    p = PrefixPolicy(PrefixPolicySettings(), members)
    # 4,000 queued tokens on a 4x replica wait like 1,000 on a 1x one
    eligible = [
        ReplicaView("big", weight=4.0, pending_prefill_tokens=4_000),
        ReplicaView("small", weight=1.0, pending_prefill_tokens=2_000),
    ]
    assert p.choose(req(chain(20, 10)), eligible).replica == "big"


def test_explain_candidates_show_queued_prefill() -> None:
    d = policy().peek(req(chain(20, 11)), views({"r3": 1234}))
    by_name = {c["replica"]: c for c in d.detail["candidates"]}
    assert by_name["r3"]["pending_prefill_tokens"] == 1234 and by_name["r0"]["pending_prefill_tokens"] == 0


# --- past the window ---------------------------------------------------------------------------
def test_index_remembers_the_prompt_length_at_the_deepest_key() -> None:
    index = AffinityIndex(1000, stride=4)
    keys = chain(10, 12)
    index.record("a", keys, prompt_tokens=9_000)
    assert index.extent("a", keys[-1]) == 9_000
    assert index.extent("a", keys[3]) is None  # only the deepest key carries it
    index.record("a", keys)  # a later request that fits its window does not erase it
    assert index.extent("a", keys[-1]) == 9_000
    index.record("a", keys, prompt_tokens=12_000)
    assert index.extent("a", keys[-1]) == 12_000
    assert index.extent("b", keys[-1]) is None


def test_a_conversation_longer_than_the_window_is_credited_with_its_history() -> None:
    p = policy()
    window = chain(256, 13)  # a full 4,096-token window
    first = p.choose(req(window, total=10_000), views())
    assert first.detail["predicted_cached_tokens"] == 0
    d = p.choose(req(window, total=12_000), views())
    assert d.replica == first.replica
    assert d.detail["matched_blocks"] == 256 and d.detail["predicted_cached_tokens"] == 10_000
    # never more than the prompt (minus vLLM's recomputed last token)
    d = p.choose(req(window, total=9_000), views())
    assert d.detail["predicted_cached_tokens"] == (9_000 - 1) // 16 * 16
    # off: the window only
    q = policy(estimate_past_window=False)
    q.choose(req(window, total=10_000), views())
    assert q.choose(req(window, total=12_000), views()).detail["predicted_cached_tokens"] == 256 * 16


def test_pipeline_estimates_the_whole_prompt() -> None:
    """Past the window the prompt is estimated at the window's own bytes per token, so text
    denser or sparser than English (whole words, CJK) is counted close to its real length."""
    p = PrefixPipeline(NormalizeSettings(), PrefixSettings(window_tokens=256, block_size=16))
    tok = get_tokenizer()
    ids = list(range(1000, 1500))
    assert p.prepare("completions", {"model": "m", "prompt": ids}).prompt_tokens_estimate == 500
    short = p.prepare("completions", {"model": "m", "prompt": "hello world"})
    assert short.prompt_tokens_estimate == short.window_tokens < 256
    for text in ("word " * 2000, "Vivid lexicon. " * 700, "数据中心的缓存命中率" * 300):
        real = len(tok.encode(text))
        estimate = p.prepare("completions", {"model": "m", "prompt": text}).prompt_tokens_estimate
        assert abs(estimate - real) <= 0.03 * real, (text[:20], estimate, real)
        naive = len(text.encode()) // 4  # the constant it replaced
        assert abs(estimate - real) < abs(naive - real)
    text = "word " * 2000  # 2,000 tokens
    chat = {
        "model": "m",
        "messages": [
            {"role": "system", "content": text},
            {"role": "user", "content": [{"type": "text", "text": text}]},
        ],
    }
    assert 3_900 <= p.prepare("chat", chat).prompt_tokens_estimate <= 4_100
    odd = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": text}, {"text": 123}]}]}
    assert 1_950 <= p.prepare("chat", odd).prompt_tokens_estimate <= 2_050  # a malformed part is skipped, no error


def test_the_runners_views_read_live_counters_including_peers() -> None:
    """The runner hands the policy live views (built once per replica): they read the counters at
    decision time, peers' shares included, exactly as a fresh ``Replica.view()`` would."""
    from gateway.config import HealthSettings, ReplicaConfig
    from gateway.replicas.pool import Replica
    from gateway.routing.runner import PolicyRunner

    pool = [Replica(ReplicaConfig(name=n, url=f"http://127.0.0.1:{9000 + i}"), None, HealthSettings())  # type: ignore[arg-type]
            for i, n in enumerate(NAMES)]  # fmt: skip
    runner = PolicyRunner("r", "prefix", policy(), pool)
    for i, r in enumerate(pool):
        r.in_flight, r.peer_in_flight = i, 10 - i
        r.pending_prefill_tokens, r.peer_pending_prefill_tokens = 100 * i, 7
    views = runner._live_views(pool)
    assert views is runner._live_views(pool)  # every replica eligible: built once, reused
    for view, r in zip(views, pool, strict=True):
        snapshot = r.view()
        assert (view.name, view.weight, view.in_flight, view.pending_prefill_tokens) == (
            snapshot.name, snapshot.weight, snapshot.in_flight, snapshot.pending_prefill_tokens)  # fmt: skip
        assert (view.kv_cache_usage, view.num_waiting) == (snapshot.kv_cache_usage, snapshot.num_waiting)
    pool[2].peer_in_flight = 50  # a peer report arrives: the same view sees it
    assert views[2].in_flight == 52
    # only some eligible: views for those, in order
    assert [v.name for v in runner._live_views(pool[1:3])] == ["r1", "r2"]
    # every replica busy but r3: the policy sees the live numbers
    for r in pool:
        r.in_flight, r.peer_in_flight, r.pending_prefill_tokens, r.peer_pending_prefill_tokens = 5, 0, 0, 0
    pool[3].in_flight = 0
    decision, replica = runner.decide(req(chain(20, 99)))
    assert replica is pool[3] and decision.replica == "r3"
