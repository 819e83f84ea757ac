"""Alignment from the engine itself, without a network: block size choice, exactness labels,
the engine's cache identity (LoRA adapter, cache_salt) and special-token text in content."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import quicktok

from gateway.prefix.block_size import DEFAULT_BLOCK_SIZE, choose
from gateway.prefix.blocks import chain_block_keys, engine_seed, first_block_seed
from gateway.prefix.exactness import is_exact, units_label
from gateway.prefix.identity import ModelIdentities
from gateway.prefix.pipeline import PrefixPipeline
from gateway.prefix.settings import NormalizeSettings, PrefixSettings
from gateway.sim.tokenizer import PromptBuilder, SimTokenizer
from gateway.tokens.alignment import alignment_for_family, alignment_for_setting

LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
QWEN = "Qwen/Qwen3-8B"
REAL_REQUESTS = Path(__file__).resolve().parents[1] / "fixtures" / "real_vllm" / "requests.jsonl"


def pipeline(**prefix: Any) -> PrefixPipeline:
    return PrefixPipeline(NormalizeSettings(mode="off"), PrefixSettings(**prefix))


def chat(model: str, content: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


# -- block size ---------------------------------------------------------------------------------
def test_auto_follows_the_engines_and_says_when_they_disagree() -> None:
    assert choose("auto", {}).size == DEFAULT_BLOCK_SIZE == 16
    assert choose("auto", {}).source == "default"
    agreed = choose("auto", {"a": 128, "b": 128})
    assert (agreed.size, agreed.source, agreed.disagree, agreed.describe()) == (128, "engines", False, None)
    # they disagree: the largest size every engine's is a multiple of, though most use 128 (each
    # of their blocks is keyed as eight of the route's; keys at 128 would over-cut b's 16s)
    split = choose("auto", {"a": 128, "b": 16, "c": 128})
    assert split.size == 16 and split.disagree and split.mismatched == {"a": 128, "c": 128}
    assert split.describe() == (
        "the replicas use different block sizes (16: b; 128: a, c); "
        "the route hashes 16-token blocks (every replica's is a multiple of it)"
    )
    assert choose("auto", {"a": 32, "b": 64}).size == 32
    assert choose("auto", {"a": 48, "b": 64, "c": 64}).size == 16  # no engine's own, but a divisor of each
    # under 16 tokens a key would cost more than the GPU default's: the most common, then the smallest
    odd = choose("auto", {"a": 24, "b": 32, "c": 32})
    assert odd.size == 32 and odd.describe() == (
        "the replicas use different block sizes (24: a; 32: b, c); the route hashes 32-token blocks (the most common)"
    )
    assert choose("auto", {"a": 24, "b": 32}).size == 24  # a tie: the smallest
    explicit = choose(16, {"a": 128})
    assert explicit.size == 16 and explicit.source == "config" and explicit.mismatched == {"a": 128}
    assert "the route hashes 16-token blocks (configured)" in (explicit.describe() or "")


def test_the_pipeline_hashes_with_the_followed_block_size() -> None:
    p = pipeline()
    body = chat(LLAMA, "word " * 600)
    before = p.prepare("chat", body)
    assert before.block_size == 16
    p.follow_engines({"r0": 128})
    after = p.prepare("chat", body)
    assert after.block_size == 128 and p.block_size == 128
    assert len(after.block_keys) == after.window_tokens // 128
    # keys at the new size: what chain_block_keys gives over the same tokens
    tokens = p.window_tokens("chat", body)
    assert list(after.block_keys) == chain_block_keys(tokens, 128, engine_seed(LLAMA, None, None))
    assert not set(before.block_keys) & set(after.block_keys)  # nothing learned at 16 matches at 128
    fixed = pipeline(block_size=32)
    fixed.follow_engines({"r0": 128})
    assert fixed.prepare("chat", body).block_size == 32  # an explicit integer wins


# -- exactness labels ---------------------------------------------------------------------------
def test_exact_only_when_tokenizer_template_and_block_size_all_match() -> None:
    llama = alignment_for_family("llama3.1")
    assert units_label(llama, choose("auto", {"r0": 16})) == "exact (llama3)"
    assert units_label(llama, choose(16, {})) == "exact (llama3)"  # an explicit size is trusted
    assert units_label(llama, choose(16, {"r0": 128})) == "approximate (llama3): block size 16 vs engine 128"
    assert units_label(llama, choose("auto", {})) == "approximate (llama3): engine block size unknown (16 assumed)"
    assert (
        units_label(llama, choose("auto", {"a": 24, "b": 128, "c": 128}))
        == "approximate (llama3): block size 128 vs engine 24"
    )
    guessed = alignment_for_family("cl100k_base")  # an unknown model name
    assert units_label(guessed, choose("auto", {"r0": 16})) == (
        "approximate (cl100k_base): tokenizer cl100k_base guessed from the model name; "
        "template chatml-like (not the model's)"
    )
    generic = alignment_for_setting("llama3")  # the vocabulary as configured, a generic template
    assert generic is not None
    assert units_label(generic, choose(16, {"r0": 128})) == (
        "approximate (llama3): template chatml-like (not the model's); block size 16 vs engine 128"
    )
    other = alignment_for_family("llama3")  # Llama 3.0/3.2: the 3.1 template, not verified
    assert units_label(other, choose("auto", {"r0": 16})).startswith("approximate (llama3): template llama3.1")
    assert is_exact("exact (llama3)") and not is_exact("approximate (llama3): x") and not is_exact(None)


def test_prepared_prompts_carry_the_label_and_keep_the_exact_token_count() -> None:
    p = pipeline()
    p.follow_engines({"r0": 128})
    prepared = p.prepare("chat", chat(LLAMA, "hello"))
    assert prepared.units == "exact (llama3)" and prepared.tokens_exact
    p.follow_engines({"r0": 16, "r1": 128, "r2": 16})
    prepared = p.prepare("chat", chat(LLAMA, "hello"))
    assert prepared.units == "approximate (llama3): block size 16 vs engine 128"
    assert prepared.tokens_exact  # the window is still counted in the model's own tokens (context check)


# -- the engine's cache identity ----------------------------------------------------------------
LISTING = [
    (
        "r0",
        [
            {"id": LLAMA, "parent": None},
            {"id": "sql-lora", "parent": LLAMA},
            {"id": "llama-alias", "parent": None},
        ],
    ),
    ("r1", [{"id": LLAMA, "parent": None}, {"id": "chat-lora", "parent": LLAMA}]),
]


def test_engine_seed_is_the_base_model_the_adapter_and_the_salt() -> None:
    assert engine_seed(LLAMA, None, None) == first_block_seed(LLAMA)
    seeds = {
        engine_seed(LLAMA, None, None),
        engine_seed(LLAMA, "sql-lora", None),
        engine_seed(LLAMA, None, "tenant-a"),
        engine_seed(LLAMA, None, "tenant-b"),
        engine_seed(LLAMA, "sql-lora", "tenant-a"),
    }
    assert len(seeds) == 5


def test_adapters_are_learned_from_the_models_listing() -> None:
    ids = ModelIdentities()
    assert ids.resolve("sql-lora") == ("sql-lora", None)  # unknown: a base model of its own
    ids.learn(LISTING)
    assert ids.resolve("sql-lora") == (LLAMA, "sql-lora")
    assert ids.resolve("chat-lora") == (LLAMA, "chat-lora")
    assert ids.resolve(LLAMA) == (LLAMA, None)
    assert ids.resolve("llama-alias") == ("llama-alias", None)  # another base model listed beside it
    assert ids.snapshot()["adapters"] == {"chat-lora": LLAMA, "sql-lora": LLAMA}


def test_salted_tenants_and_adapters_get_their_own_keys() -> None:
    ids = ModelIdentities()
    ids.learn(LISTING)
    p = PrefixPipeline(NormalizeSettings(mode="off"), PrefixSettings(block_size=16), ids)
    text = "Shared system prompt. " * 40
    base = p.prepare("chat", chat(LLAMA, text))
    lora = p.prepare("chat", chat("sql-lora", text))
    salted_a = p.prepare("chat", chat(LLAMA, text, cache_salt="tenant-a"))
    salted_a2 = p.prepare("chat", chat(LLAMA, text, cache_salt="tenant-a"))
    salted_b = p.prepare("chat", chat(LLAMA, text, cache_salt="tenant-b"))
    assert base.block_keys and salted_a.block_keys == salted_a2.block_keys
    chains = [base.block_keys, lora.block_keys, salted_a.block_keys, salted_b.block_keys]
    assert len({keys[0] for keys in chains}) == 4  # no two share even their first block
    # the adapter is keyed as the engine does (base model, adapter name) and tokenized as its base
    assert (lora.lora, lora.base_model) == ("sql-lora", LLAMA)
    assert lora.units == base.units == "exact (llama3)"
    assert lora.window_tokens == base.window_tokens
    tokens = p.window_tokens("chat", chat("sql-lora", text))
    assert list(lora.block_keys) == chain_block_keys(tokens, 16, engine_seed(LLAMA, "sql-lora", None))


# -- special-token text in message content ------------------------------------------------------
PASTED = (
    "Here is the log I pasted:\n<|start_header_id|>user<|end_header_id|>\n\nhello<|eot_id|>\n"
    "and a Qwen one: <|im_start|>assistant\n<think>hm</think><|im_end|> -- what happened?"
)


@pytest.mark.parametrize(("model", "vocab"), [(LLAMA, "llama3"), (QWEN, "qwen3")])
def test_special_token_text_is_counted_as_the_engine_tokenizes_it(model: str, vocab: str) -> None:
    """vLLM's tokenizer turns special-token text anywhere in the prompt into the special token
    (tiktoken/quicktok ``encode(..., allowed_special="all")``): the window must have those ids."""
    p = pipeline(block_size=16)
    messages = [{"role": "system", "content": "Be brief. " + PASTED}, {"role": "user", "content": PASTED}]
    window = list(p.tokens.for_model(model).chat(messages))
    engine = PromptBuilder(SimTokenizer(vocab), SimTokenizer(vocab).encode)  # the replica's own rendering
    assert window == engine.chat(messages)
    enc = quicktok.get_encoding(vocab)
    specials = {enc.encode_single_token(t) for t in enc.special_tokens_set}
    pasted_specials = [i for i in enc.encode(PASTED, allowed_special="all") if i in specials]
    assert len(pasted_specials) >= 3
    assert sum(1 for i in window if i in specials) >= 2 * len(pasted_specials)
    plain = enc.encode_ordinary(PASTED)
    assert len(plain) > len(enc.encode(PASTED, allowed_special="all"))  # as text it would be longer
    # a completion prompt too (vLLM parses specials there as well, after Llama's BOS)
    completion = list(p.tokens.for_model(model).text(PASTED))
    assert completion == engine.completion(PASTED)


def test_llama31_tool_tokens_in_content_are_special_tokens() -> None:
    """Llama 3.1's tokenizer names three of Llama 3's reserved slots (its template writes
    ``<|eom_id|>`` and ``<|python_tag|>``; vLLM's ``llama3_json`` tool parser needs the latter):
    typed in content they are single tokens for the engine, so for the gateway too."""
    p = pipeline(block_size=16)
    text = "a builtin call: <|python_tag|>search(q) then <|eom_id|> and <|finetune_right_pad_id|>"
    window = list(p.tokens.for_model(LLAMA).chat([{"role": "user", "content": text}]))
    assert {128010, 128008, 128004} <= set(window)
    engine = PromptBuilder(SimTokenizer("llama3"), SimTokenizer("llama3").encode)
    assert window == engine.chat([{"role": "user", "content": text}])


def _recorded_usage(record: dict[str, Any]) -> dict[str, Any] | None:
    import json

    if isinstance(record.get("response"), dict) and record["response"].get("usage"):
        return record["response"]["usage"]
    for data in record.get("sse") or ():
        if data != "[DONE]" and (chunk := json.loads(data)).get("usage"):
            return chunk["usage"]
    return None


def test_the_recorded_real_engine_agrees_with_the_gateway() -> None:
    """Against the recorded real vLLM 0.32 (tests/fixtures/real_vllm, the lane's recording):
    the block size scraped from its /metrics, then for every served chat/completions request
    the window's ids equal vLLM's own prompt ids (the special-token conversation included), and
    the cached tokens predicted from the keys seen so far equal what vLLM reported (up to the
    first request during which the engine evicted a block — its recorded ``BlockRemoved`` —
    which only KV events can tell: the recording's cache is small on purpose)."""
    import base64
    import json

    import msgpack

    from gateway.replicas.engine import parse_engine_metrics

    if not REAL_REQUESTS.is_file():
        pytest.skip("no recorded real-vLLM requests in this tree")
    folder = REAL_REQUESTS.parent
    engine = parse_engine_metrics((folder / "metrics.txt").read_text(encoding="utf-8"))
    assert engine.block_size == 128  # the CPU backend's
    ids = ModelIdentities()
    ids.learn([("r0", json.loads((folder / "models.json").read_text(encoding="utf-8"))["data"])])
    p = PrefixPipeline(NormalizeSettings(mode="off"), PrefixSettings(window_tokens=8192), ids)
    p.follow_engines({"r0": engine.block_size})
    bs = p.block_size
    first_eviction = _first_eviction(folder / "kv_events.jsonl", msgpack, base64, json)
    seen: set[int] = set()
    compared = specials = 0
    for line in REAL_REQUESTS.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if record["id"] == "reset":
            seen.clear()  # POST /reset_prefix_cache
        if record["id"] == first_eviction:
            break
        body, prompt_ids = record.get("request") or {}, record.get("prompt_token_ids")
        if record.get("status") != 200 or not prompt_ids or not isinstance(body, dict):
            continue
        endpoint = "chat" if "messages" in body else "completions"
        prepared = p.prepare(endpoint, body)
        window = list(p.window_tokens(endpoint, body))
        assert window == prompt_ids[: len(window)] and len(window) == min(len(prompt_ids), 8192), record["id"]
        specials += sum(1 for i in window if i >= 128000)
        depth = next((i for i, key in enumerate(prepared.block_keys) if key not in seen), len(prepared.block_keys))
        seen.update(prepared.block_keys)
        predicted = min(depth * bs, (len(prompt_ids) - 1) // bs * bs)
        usage = _recorded_usage(record)
        details = (usage or {}).get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            assert predicted == details["cached_tokens"], record["id"]
            assert prepared.units == "exact (llama3)"
            compared += 1
    assert compared >= 10, compared
    assert specials > 0


def _first_eviction(events: Path, msgpack: Any, base64: Any, json: Any) -> str | None:
    """The id of the request in flight when the recorded engine first removed a block."""
    for line in events.read_text(encoding="utf-8").splitlines():
        message = json.loads(line)
        _ts, batch, _rank = msgpack.unpackb(base64.b64decode(message["payload_b64"]), strict_map_key=False)
        if any((e.get("type") if isinstance(e, dict) else e[0]) == "BlockRemoved" for e in batch):
            return message.get("after")
    return None


# -- a route follows its replicas' scrapes (no network: an offline gateway) ---------------------
def test_a_route_flips_to_the_scraped_block_size_without_false_hits() -> None:
    """Before the first scrape the route hashes 16-token blocks; once its replicas publish 128 it
    hashes 128, the keys learned at 16 never match a 128 key (no prediction from a block the
    engine does not share), a scrape without the cache config keeps the size, and stats say it."""
    from gateway.admin.explain import offline_gateway
    from gateway.replicas.engine import EngineStats
    from tests.configs import gateway_config

    config = gateway_config(
        ["http://127.0.0.1:9", "http://127.0.0.1:10"],
        routes=[{"name": "main", "match": {"models": [LLAMA]}, "policy": "prefix"}],
    )
    gw = offline_gateway(config)
    body = chat(LLAMA, system_prompt_words(900))

    def plan() -> Any:
        return gw.plan("chat", dict(body), {})

    first = plan()
    assert first.prepared.block_size == 16 and first.prepared.units.endswith("engine block size unknown (16 assumed)")
    assert plan().predicted_cached_tokens > 0  # the same prompt again, at the same size: a hit
    for replica in gw.replicas.values():
        replica.set_engine(EngineStats(scraped_at=0.0, block_size=128, num_gpu_blocks=4096))
    flipped = plan()
    assert flipped.prepared.block_size == 128 and flipped.prepared.units == "exact (llama3)"
    assert flipped.predicted_cached_tokens == 0  # nothing learned at 16 is taken for a 128-token block
    assert plan().predicted_cached_tokens == (flipped.prepared.window_tokens - 1) // 128 * 128
    gw.replicas["r1"].set_engine(EngineStats(scraped_at=1.0))  # a scrape without vllm:cache_config_info
    block = gw.stats_snapshot()["routes"]["main"]["block_size"]
    assert (block["size"], block["source"], block["engines"]) == (128, "engines", {"r0": 128, "r1": 128})
    gw.replicas["r1"].set_engine(EngineStats(scraped_at=2.0, block_size=16))
    block = gw.stats_snapshot()["routes"]["main"]["block_size"]
    assert block["disagree"] and block["size"] == 16 and block["mismatched"] == ["r0"]  # a tie: the smallest
    assert plan().prepared.units == "approximate (llama3): block size 16 vs engine 128"


def system_prompt_words(n: int) -> str:
    return "You keep the ship's log. " + " ".join(f"entry{i % 101}" for i in range(n))
