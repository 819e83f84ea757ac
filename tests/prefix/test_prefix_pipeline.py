"""Window tokenizer (cached) and the pipeline: exact tokens, stable keys, seeds, normalization effect."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.prefix.blocks import chain_block_keys, first_block_seed
from gateway.prefix.pipeline import PrefixPipeline
from gateway.prefix.settings import NormalizeSettings, PrefixSettings
from gateway.tokens.chat_template import chat_tokens, encode_segments
from gateway.tokens.tokenizer import get_tokenizer
from gateway.tokens.window import SegmentTokenCache, WindowTokenizer

TOK = get_tokenizer()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_text = st.text(alphabet="abcdefgh ijk\n.,:0123!<|>é中", max_size=400)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "developer"]), "content": _text}
)


@settings(max_examples=60, deadline=None)
@given(st.lists(_message, min_size=1, max_size=6), st.integers(16, 300), st.booleans())
def test_cached_window_equals_chat_tokens(messages: list[dict[str, Any]], window: int, tools: bool) -> None:
    """The cache is pure memoization: the window equals the full template's tokens, cold and warm."""
    tool_list = [{"type": "function", "function": {"name": "f", "description": "d"}}] if tools else None
    wt = WindowTokenizer(TOK, window, 10_000)
    expected = chat_tokens(TOK, messages, tool_list)[:window]
    assert list(wt.chat(messages, tool_list)) == expected
    assert list(wt.chat(messages, tool_list)) == expected  # warm


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet="ab cd\n1234", min_size=0, max_size=3000), st.integers(16, 200))
def test_cached_window_on_long_single_segment(text: str, window: int) -> None:
    wt = WindowTokenizer(TOK, window, 10_000)
    assert list(wt.text(text)) == encode_segments(TOK, [text], max_tokens=window)[:window]
    assert list(wt.text(text)) == TOK.encode(text)[:window]


def test_segment_cache_is_bounded_and_lru() -> None:
    cache = SegmentTokenCache(TOK, max_tokens=50)
    words = [f"word{i} " * 5 for i in range(20)]
    for w in words:
        cache.encode(w)
    assert cache.tokens_held <= 50
    held = cache.tokens_held
    cache.encode(words[-1])
    assert cache.hits == 1 and cache.tokens_held == held
    cache.encode(words[0])  # evicted long ago
    assert cache.misses == 21


def test_segment_cache_disabled() -> None:
    cache = SegmentTokenCache(TOK, max_tokens=0)
    assert list(cache.encode("hello world")) == TOK.encode("hello world")
    assert len(cache) == 0


# --- pipeline ---------------------------------------------------------------------------------
def pipeline(mode: str = "off", **prefix: Any) -> PrefixPipeline:
    # always=["*"]: move on first sight (learning what varies is tested in test_prefix_normalize_learn.py)
    settings = NormalizeSettings(mode=mode, always=["*"])  # type: ignore[arg-type]
    return PrefixPipeline(settings, PrefixSettings(**prefix))


SYSTEM = "You are a careful assistant for ACME. " * 20


def body(stamp: str, user: str = "Where is my order?", **extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": f"Current time: {stamp}.\n{SYSTEM}"},
            {"role": "user", "content": user},
        ],
        **extra,
    }


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_keys_match_the_shared_template_and_blocks() -> None:
    p = pipeline(window_tokens=64, block_size=16)
    b = body("2025-03-04T05:06:07Z")
    prepared = p.prepare("chat", b)
    tokens = chat_tokens(TOK, b["messages"], max_tokens=64)[:64]
    assert prepared.block_keys == tuple(chain_block_keys(tokens, 16, first_block_seed("m")))
    assert prepared.window_tokens == 64 and len(prepared.block_keys) == 4
    assert prepared.body is b and not prepared.relocated


def test_relocate_makes_requests_that_differ_only_in_a_timestamp_share_keys() -> None:
    a, b = body("2025-03-04T05:06:07Z"), body("2025-03-04T05:06:09Z")
    off = pipeline("off")
    # Without normalization the keys part ways at the timestamp (inside block 0 or 1).
    assert common_prefix(off.prepare("chat", a).block_keys, off.prepare("chat", b).block_keys) <= 1
    reloc = pipeline("relocate")
    ka, kb = reloc.prepare("chat", a).block_keys, reloc.prepare("chat", b).block_keys
    # Everything up to the relocated values (in the last user message) is shared.
    assert common_prefix(ka, kb) >= len(ka) - 5 and len(ka) > 10  # all but the values block
    report = pipeline("report").prepare("chat", a)
    assert report.body is a and report.normalized == {"iso_datetime": 1} and not report.relocated


def test_pipeline_reports_relocation_fields() -> None:
    prepared = pipeline("relocate").prepare("chat", body("2025-03-04T05:06:07Z"))
    assert prepared.relocated and prepared.spans_moved == 1 and prepared.normalized == {"iso_datetime": 1}
    assert prepared.changes[0].value == "2025-03-04T05:06:07Z"


def test_keys_differ_by_model_salt_and_lora() -> None:
    p = pipeline()
    base = p.prepare("chat", body("x")).block_keys
    assert p.prepare("chat", {**body("x"), "model": "other"}).block_keys[0] != base[0]
    salted = p.prepare("chat", body("x", cache_salt="tenant-a")).block_keys
    assert salted[0] != base[0]
    assert p.prepare("chat", body("x", cache_salt="tenant-b")).block_keys[0] != salted[0]
    lora = pipeline(lora_from_model=True, base_model="base")
    keys = lora.prepare("chat", {**body("x"), "model": "adapter-1"}).block_keys
    assert keys[0] not in (base[0],)
    assert lora.prepare("chat", {**body("x"), "model": "adapter-1"}).lora == "adapter-1"
    assert lora.prepare("chat", {**body("x"), "model": "adapter-2"}).block_keys[0] != keys[0]


def test_completions_prompts() -> None:
    p = pipeline(window_tokens=32, block_size=8)
    text = "one two three four five six seven eight nine ten " * 10
    by_text = p.prepare("completions", {"model": "m", "prompt": text})
    assert by_text.window_tokens == 32 and len(by_text.block_keys) == 4
    ids = TOK.encode(text)
    by_ids = p.prepare("completions", {"model": "m", "prompt": ids})
    assert by_ids.block_keys == by_text.block_keys
    assert p.prepare("completions", {"model": "m", "prompt": [text, "x"]}).block_keys == by_text.block_keys
    assert p.prepare("completions", {"model": "m", "prompt": [ids]}).block_keys == by_text.block_keys
    assert p.prepare("completions", {"model": "m", "prompt": [-1, 2**40]}).block_keys == ()
    assert p.prepare("embeddings", {"model": "m", "input": "x"}).block_keys == ()


_SCRIPT = """
import json, sys
sys.path.insert(0, {root!r})
from gateway.prefix.pipeline import PrefixPipeline
from gateway.prefix.settings import NormalizeSettings, PrefixSettings
p = PrefixPipeline(NormalizeSettings(mode="relocate", always=["*"]), PrefixSettings())
body = json.loads(sys.argv[1])
print(json.dumps(list(p.prepare("chat", body).block_keys)))
"""


@pytest.mark.slow
def test_keys_are_stable_across_processes() -> None:
    b = body("2025-03-04T05:06:07Z", cache_salt="s")
    here = list(pipeline("relocate").prepare("chat", b).block_keys)
    outs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", _SCRIPT.format(root=ROOT), json.dumps(b)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        outs.append(json.loads(out.stdout))
    assert outs[0] == outs[1] == here


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet="ab cd\n1234中文", min_size=0, max_size=3000), st.integers(16, 200))
def test_window_without_exact_cuts_follows_the_shared_rule(text: str, window: int) -> None:
    """For tokenizers without provably exact cut points (HF), the shared slice+slack rule applies."""
    wt = WindowTokenizer(TOK, window, 10_000)
    wt._exact_cuts = False
    assert list(wt.text(text)) == encode_segments(TOK, [text], max_tokens=window)[:window]


def test_long_text_without_spaces_falls_back() -> None:
    text = "中文字符" * 3000
    wt = WindowTokenizer(TOK, 100, 10_000)
    assert list(wt.text(text)) == TOK.encode(text)[:100]


# --- whole-prompt keys: the chain continues past the window ------------------------------------
def words(n: int, seed: int) -> str:
    """~n cl100k tokens of varied words (deterministic)."""
    rnd = random.Random(seed)
    return " ".join(f"{rnd.choice(['alpha', 'beta', 'gamma', 'delta'])}{rnd.randrange(1000)}" for _ in range(n // 2))


HEAD_30K = words(30_000, 1)


def agent(tail: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "system", "content": HEAD_30K}, {"role": "user", "content": tail}]}


def test_a_30k_token_shared_head_with_different_tails_gets_different_deepest_keys() -> None:
    p = pipeline()
    a, b = p.prepare("chat", agent("Plan my trip to Lisbon.")), p.prepare("chat", agent("Plan my trip to Oslo."))
    assert a.block_keys == b.block_keys and a.window_tokens == 4096  # the window is all shared head
    assert a.keys[-1] != b.keys[-1]
    assert len(a.text_keys) > 20 and a.prompt_tokens_estimate > 25_000
    # They part only at the tail: every key of the head (up to the last chunk of the system message) agrees.
    shared = common_prefix(a.keys, b.keys)
    assert shared == len(a.keys) - 1 == len(b.keys) - 1
    assert a.text_key_tokens[shared - 1 - len(a.block_keys)] > 25_000  # that much is predicted shared


def test_a_conversations_next_turn_contains_every_key_of_the_last() -> None:
    p = pipeline()
    messages: list[dict[str, Any]] = [{"role": "system", "content": HEAD_30K}]
    previous: tuple[int, ...] = ()
    for turn in range(4):
        messages = [*messages, {"role": "user", "content": f"Question {turn}: " + words(300, 10 + turn)}]
        keys = p.prepare("chat", {"model": "m", "messages": messages}).keys
        assert keys[: len(previous)] == previous, turn  # turn N+1 matches turn N's full length
        assert len(keys) > len(previous)
        previous = keys
        messages.append({"role": "assistant", "content": words(200, 50 + turn)})


def test_text_keys_differ_wherever_the_text_differs() -> None:
    p = pipeline()
    base = HEAD_30K
    pos = len(base) * 2 // 3  # deep past the window
    changed = base[:pos] + ("X" if base[pos] != "X" else "Y") + base[pos + 1 :]
    a, b = (
        p.prepare("chat", agent("same")),
        p.prepare(
            "chat",
            {
                **agent("same"),
                "messages": [{"role": "system", "content": changed}, {"role": "user", "content": "same"}],
            },
        ),
    )
    shared = common_prefix(a.keys, b.keys)
    assert len(a.block_keys) < shared < len(a.keys)
    # Same text under other roles, tools, or another model gets other keys.
    other_role = p.prepare(
        "chat",
        {**agent("same"), "messages": [{"role": "developer", "content": base}, {"role": "user", "content": "same"}]},
    )
    assert other_role.keys[-1] != a.keys[-1]
    with_tools = p.prepare("chat", {**agent("same"), "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert with_tools.keys[-1] != a.keys[-1]


def test_completions_continue_past_the_window() -> None:
    p = pipeline(window_tokens=64, block_size=16)
    text = words(2_000, 3)
    a = p.prepare("completions", {"model": "m", "prompt": text + " end one"})
    b = p.prepare("completions", {"model": "m", "prompt": text + " end two"})
    assert a.block_keys == b.block_keys and a.keys[-1] != b.keys[-1]
    ids = TOK.encode(text)
    by_ids = p.prepare("completions", {"model": "m", "prompt": ids})
    assert by_ids.block_keys == a.block_keys
    assert len(by_ids.text_keys) == -(-(len(ids) - 64) // 256) and by_ids.text_key_tokens[-1] == len(ids)
    longer = p.prepare("completions", {"model": "m", "prompt": [*ids, 7, 8, 9]})
    assert longer.keys[: len(by_ids.keys) - 1] == by_ids.keys[:-1] and longer.keys[-1] != by_ids.keys[-1]


def test_short_prompts_have_token_keys_only() -> None:
    prepared = pipeline().prepare("chat", body("x"))
    assert prepared.text_keys == () and prepared.keys == prepared.block_keys


# --- bad input never raises: routed by what can be keyed --------------------------------------
def nested(depth: int) -> Any:
    value: Any = "deep"
    for _ in range(depth):
        value = [{"type": "text", "text": value}]
    return value


def test_a_million_character_prompt_is_keyed() -> None:
    p = pipeline("relocate")
    huge = "lorem ipsum dolor sit amet " * 37_037  # ~1M characters
    for endpoint, request in (
        ("chat", {"model": "m", "messages": [{"role": "user", "content": huge}]}),
        ("completions", {"model": "m", "prompt": huge}),
    ):
        prepared = p.prepare(endpoint, request)
        assert prepared.window_tokens == 4096 and len(prepared.text_keys) > 900
        real = 37.037 * len(get_tokenizer().encode(huge[: 27 * 1000]))  # ~185k tokens, not 1M / 4
        assert abs(prepared.prompt_tokens_estimate - real) <= 0.02 * real


def test_deeply_nested_and_non_text_parts_never_raise() -> None:
    """Bodies that pass ``parse_body`` (a list of messages with string roles) but hold anything else."""
    p = pipeline("relocate")
    odd_parts = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 5000}},
        {"type": "input_audio", "input_audio": {"data": "UklGR", "format": "wav"}},
        {"type": "text", "text": {"not": "a string"}},
        {"type": ["weird"]},
        42,
        None,
        "plain string part",
    ]
    bodies = [
        {"model": "m", "messages": [{"role": "user", "content": nested(5_000)}]},
        {"model": "m", "messages": [{"role": "user", "content": odd_parts}]},
        {"model": "m", "messages": [{"role": "assistant", "content": "hi", "name": 5, "tool_calls": nested(3_000)}]},
        {"model": "m", "messages": [{"role": "user", "content": {"a": nested(3_000)}}, {"role": "tool", "content": 7}]},
        {"model": "m", "messages": [{"role": "system", "content": nested(3_000)}, {"role": "user", "content": "x"}]},
        {"model": "m", "messages": [{"role": "user", "content": HEAD_30K}], "tools": nested(3_000)},
    ]
    for request in bodies:
        prepared = p.prepare("chat", request)  # must not raise
        assert isinstance(prepared.keys, tuple)
    # Non-text parts are keyed by their URL/data: two images give two keys, the same image the same.
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/1.png"}}]}
    other = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/2.png"}}]}
    a = p.prepare("chat", {"model": "m", "messages": [image]}).keys
    assert a and a != p.prepare("chat", {"model": "m", "messages": [other]}).keys
    assert a == p.prepare("chat", {"model": "m", "messages": [image]}).keys
    # Unrenderable content still gets keys from what can be read (the long text after it).
    mixed = {
        "model": "m",
        "messages": [{"role": "user", "content": nested(5_000)}, {"role": "user", "content": HEAD_30K}],
    }
    assert p.prepare("chat", mixed).keys


def test_our_values_block_past_the_window_is_counted_in_tokens_not_bytes() -> None:
    """Relocation appends its values block at the prompt's end; its ids tokenize far denser
    than prose, so it is tokenized (it is short): the estimate grows by its exact tokens, and
    the keys before it keep theirs.  A look-alike without our checksum is text like any other."""
    from gateway.prefix.volatile import placeholder, values_block

    p = pipeline(window_tokens=64)
    head = words(3000, 7)
    block = values_block([f"{placeholder('hex_id', i)} = {i:032x}{'5267298e6f3142' * 2}" for i in range(1, 6)])
    fake = block.replace('check="', 'check="0')  # a wrong checksum: not ours

    def prepared(content: str) -> Any:
        return p.prepare("chat", {"model": "m", "messages": [{"role": "user", "content": content}]})

    plain, ours, other = prepared(head), prepared(f"{head}\n\n{block}"), prepared(f"{head}\n\n{fake}")
    exact = len(p.tokens.for_model("m").tokenizer.encode(block))
    ratio = (len(block) + 2) / (ours.prompt_tokens_estimate - plain.prompt_tokens_estimate)
    assert exact > (len(block) + 2) / 3.0  # denser than prose: the bytes would under-count it
    assert abs(ours.prompt_tokens_estimate - plain.prompt_tokens_estimate - exact) <= 2, ratio
    assert other.prompt_tokens_estimate - plain.prompt_tokens_estimate < exact - 10  # counted at bytes
    shared = common_prefix(plain.text_keys, ours.text_keys)
    assert ours.text_key_tokens[:shared] == plain.text_key_tokens[:shared]  # before it: unchanged
