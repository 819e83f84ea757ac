"""The prefix cache counts hits exactly like vLLM: whole blocks, chained keys, LRU, capacity."""

from __future__ import annotations

import random

import httpx
import openai
import pytest
from sim_helpers import SIM_PROMPTS, SIM_TOKENIZER, client

from gateway.sim import DEFAULT_MODEL
from gateway.sim.hashing import block_hashes, block_seed
from gateway.sim.kvcache import PrefixCache, hit_block_limit
from gateway.sim.options import SimOptions
from gateway.sim.replica import Replica as SimReplica

BLOCK = 16


def _words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    vocab = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "epsilon",
        "zeta",
        "theta",
        "kappa",
        "lambda",
        "sigma",
        "omega",
        "river",
        "stone",
        "cloud",
    ]
    return " ".join(rng.choice(vocab) for _ in range(n))


def _cached(resp: openai.types.Completion | openai.types.chat.ChatCompletion) -> int:
    assert resp.usage is not None and resp.usage.prompt_tokens_details is not None
    return resp.usage.prompt_tokens_details.cached_tokens or 0


def test_same_2000_token_prompt_twice(oai: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": _words(1860, seed=1)}]
    first = oai.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=2)
    second = oai.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=2)
    assert first.usage is not None
    prompt_len = first.usage.prompt_tokens
    assert 1950 <= prompt_len <= 2050
    assert _cached(first) == 0
    hit = _cached(second)
    assert hit % BLOCK == 0
    assert hit == (prompt_len - 1) // BLOCK * BLOCK  # every full block but the one holding the last token
    assert prompt_len - hit <= BLOCK


def test_hit_cap_when_prompt_is_a_whole_number_of_blocks(oai: openai.OpenAI) -> None:
    """vLLM caps the hit at prompt_len - 1 tokens: a block-aligned prompt recomputes its last block."""
    ids = list(range(1000, 1000 + 4 * BLOCK))
    oai.completions.create(model=DEFAULT_MODEL, prompt=ids, max_tokens=1)
    again = oai.completions.create(model=DEFAULT_MODEL, prompt=ids, max_tokens=1)
    assert _cached(again) == 3 * BLOCK
    longer = oai.completions.create(model=DEFAULT_MODEL, prompt=[*ids, 7], max_tokens=1)
    assert _cached(longer) == 4 * BLOCK
    assert hit_block_limit(64, 16) == 3 and hit_block_limit(65, 16) == 4 and hit_block_limit(1, 16) == 0


def test_shared_system_prompt_hits_exactly_the_shared_whole_blocks(oai: openai.OpenAI) -> None:
    system = {"role": "system", "content": _words(500, seed=2)}
    a = [system, {"role": "user", "content": "What is the weather like today in Paris?"}]
    b = [system, {"role": "user", "content": "Summarize the history of Rome in one line."}]
    oai.chat.completions.create(model=DEFAULT_MODEL, messages=a, max_tokens=1)
    resp = oai.chat.completions.create(model=DEFAULT_MODEL, messages=b, max_tokens=1)
    ta, tb = SIM_PROMPTS.chat(a), SIM_PROMPTS.chat(b)
    common = next(i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y)
    assert common >= len(SIM_PROMPTS.chat([system], add_generation_prompt=False))
    assert _cached(resp) == common // BLOCK * BLOCK
    assert _cached(resp) > 0


def test_cache_salt_and_lora_separate_tenants(make_sim) -> None:
    c = client(make_sim(lora_modules=["adapter"]))
    ids = list(range(5000, 5000 + 10 * BLOCK))
    c.completions.create(model=DEFAULT_MODEL, prompt=ids, max_tokens=1)
    salted = c.completions.create(model=DEFAULT_MODEL, prompt=ids, max_tokens=1, extra_body={"cache_salt": "t1"})
    assert _cached(salted) == 0
    salted_again = c.completions.create(model=DEFAULT_MODEL, prompt=ids, max_tokens=1, extra_body={"cache_salt": "t1"})
    assert _cached(salted_again) == 9 * BLOCK
    lora = c.completions.create(model="adapter", prompt=ids, max_tokens=1)
    assert _cached(lora) == 0


def _two_turns(oai: openai.OpenAI) -> tuple[int, int, str]:
    """(tokens the first turn computed, the second turn's cached tokens, the first reply)."""
    history = [
        {"role": "system", "content": _words(200, seed=3)},
        {"role": "user", "content": "Tell me a story."},
    ]
    first = oai.chat.completions.create(model=DEFAULT_MODEL, messages=history, max_tokens=64)
    assert first.usage is not None
    reply = first.choices[0].message.content or ""
    history += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
    second = oai.chat.completions.create(model=DEFAULT_MODEL, messages=history, max_tokens=4)
    return first.usage.prompt_tokens + 64 - 1, _cached(second), reply


def test_next_chat_turn_hits_the_previous_reply(make_sim) -> None:
    """Output tokens are cached too; with replies that re-tokenize exactly (drift 0) the next
    turn hits everything the first computed, in full blocks."""
    computed, cached, _ = _two_turns(client(make_sim(retokenize_drift=0)))
    assert cached == computed // BLOCK * BLOCK
    assert cached > computed - 64


def test_replies_that_retokenize_differently_cut_the_next_turns_hit(make_sim) -> None:
    """A real model's ids are often not what its text re-encodes to (the recorded vLLM: 6 of
    23 replies re-encode to another length): with drift, the same reply text comes back as
    other ids, and the next turn hits only up to the block before the first difference."""
    exact = _two_turns(client(make_sim(retokenize_drift=0)))
    drifted = _two_turns(client(make_sim(retokenize_drift=1.0)))
    # the same words (a word in two pieces reads the same; two pieces take two of the 64 tokens)
    assert exact[2].startswith(drifted[2]) and len(drifted[2]) > len(exact[2]) // 2
    assert drifted[0] == exact[0]
    prompt_tokens = exact[0] - 63
    assert prompt_tokens // BLOCK * BLOCK <= drifted[1] < exact[1]  # the prompt still hits; the reply's blocks do not


def test_drift_splits_words_into_pieces_that_spell_them() -> None:
    from gateway.sim.textgen import TextGenerator

    gen = TextGenerator(SIM_TOKENIZER, seed=0, drift=0.5)
    ids = gen.token_ids(12345, 0, 400)
    text = gen.render(ids)
    assert len(ids) == 400 and SIM_TOKENIZER.decode(ids) == text
    assert len(SIM_TOKENIZER.encode(text)) < 400  # some words came out in two pieces
    exact = TextGenerator(SIM_TOKENIZER, seed=0, drift=0.0)
    assert SIM_TOKENIZER.encode(exact.render(exact.token_ids(12345, 0, 400))) == exact.token_ids(12345, 0, 400)


def test_small_kv_cache_evicts_older_prefixes(make_sim) -> None:
    url = make_sim(num_gpu_blocks=40, block_size=BLOCK, max_model_len=640, enable_admin=True)
    c = client(url)
    prompts = [[10_000 * (k + 1) + i for i in range(10 * BLOCK)] for k in range(6)]  # 10 blocks each
    for p in prompts:
        c.completions.create(model=DEFAULT_MODEL, prompt=p, max_tokens=1)
    # capacity 40 blocks: the two newest prompts (plus part of older ones) survive, the oldest is gone
    assert _cached(c.completions.create(model=DEFAULT_MODEL, prompt=prompts[0], max_tokens=1)) == 0
    state = httpx.get(url + "/sim/state").json()
    assert state["num_cached_blocks"] <= 40 and state["kv_cache_usage"] == 0.0
    assert _cached(c.completions.create(model=DEFAULT_MODEL, prompt=prompts[5], max_tokens=1)) == 9 * BLOCK
    # re-use refreshes LRU order: prompt 5 was just used, so it survives two more new prompts
    for k in (6, 7):
        c.completions.create(
            model=DEFAULT_MODEL, prompt=[10_000 * (k + 1) + i for i in range(10 * BLOCK)], max_tokens=1
        )
    assert _cached(c.completions.create(model=DEFAULT_MODEL, prompt=prompts[5], max_tokens=1)) == 9 * BLOCK
    assert _cached(c.completions.create(model=DEFAULT_MODEL, prompt=prompts[2], max_tokens=1)) == 0


# -- the block pool itself ----------------------------------------------------------------------


def _keys(tokens: list[int]) -> list[int]:
    return block_hashes(tokens, 4, block_seed("m", None, None))


def _serve(cache: PrefixCache, tokens: list[int]) -> int:
    """Admit, compute and finish one sequence (as run_instant does); return its hit in tokens."""
    keys = _keys(tokens)
    hit = cache.lookup(keys, len(tokens))
    need = -(-len(tokens) // 4) - len(hit)
    assert cache.can_allocate(hit, need)
    cache.touch(hit)
    blocks = hit + cache.allocate(need)
    cache.commit(blocks, keys, len(hit), len(tokens) // 4)
    cache.free(blocks)
    return len(hit) * 4


def test_pool_lru_evicts_tail_blocks_first_and_keeps_prefix_heads() -> None:
    cache = PrefixCache(num_blocks=4, block_size=4)
    a = list(range(100, 109))  # 2 full blocks + 1 partial -> 3 blocks
    assert _serve(cache, a) == 0
    assert cache.num_cached == 2 and cache.usage == 0.0
    # b needs 3 blocks: the never-used one, then a's partial tail, then a's second full block
    b = list(range(200, 209))
    _serve(cache, b)
    assert _serve(cache, a) == 4  # a's first block survived, its second was evicted


def test_pool_pinned_blocks_are_never_evicted() -> None:
    cache = PrefixCache(num_blocks=4, block_size=4)
    tokens = list(range(12))
    keys = _keys(tokens)
    blocks = cache.allocate(3)
    cache.commit(blocks, keys, 0, 3)  # a running request holds 3 computed blocks
    assert cache.usage == pytest.approx(0.75)
    assert not cache.can_allocate([], 2)
    other = cache.allocate(1)
    assert cache.lookup(keys, 13) == blocks  # nothing of the running request was evicted
    cache.free(other)
    cache.free(blocks)
    assert cache.usage == 0.0 and cache.num_cached == 3
    with pytest.raises(RuntimeError):
        cache.touch(cache.lookup(keys, 13))
        cache.reset()


def test_a_request_admitted_in_its_leaders_step_hits_the_blocks_that_step_computes() -> None:
    # As vLLM v1 (it caches a block when it allocates the step's slots): a burst of one
    # prompt queued behind a busy engine runs in one step, and every request but the first
    # finds the prompt's full blocks cached — measured on vLLM 0.32 CPU, and recorded in
    # tests/real_vllm/test_lane_2_cache_changes.py.
    replica = SimReplica(SimOptions(time_scale=1.0, block_size=BLOCK, max_num_batched_tokens=2048))
    engine = replica.engine
    prompt = list(range(1000, 1000 + 10 * BLOCK + 3))
    seed = replica.block_seed(None, None)
    leader, follower = (replica.engine_requests(prompt, 2, "length", 1, seed, 0.0)[0] for _ in range(2))
    engine.waiting.extend([leader, follower])
    scheduled, _ = engine._schedule()
    assert [req for req, _ in scheduled] == [leader, follower]  # one step, both admitted
    assert (leader.cached_tokens, follower.cached_tokens) == (0, 10 * BLOCK)
    engine._apply(scheduled)
    again = replica.engine_requests(prompt, 2, "length", 1, seed, 0.0)[0]
    engine.waiting.append(again)
    engine._schedule()
    assert again.cached_tokens == 10 * BLOCK  # and they stay cached once computed
