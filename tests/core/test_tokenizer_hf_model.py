"""``tokenizer: hf:DIR``: a local Hugging Face model directory gives exact alignment, offline.

A small byte-level BPE tokenizer is trained here (no download) with ChatML special tokens and
saved with a ``tokenizer_config.json`` holding Qwen2.5's published chat template.  The
gateway's window must equal what vLLM computes: the template rendered with jinja2, then the
whole string encoded by the same ``tokenizer.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.config import parse_config
from gateway.prefix.pipeline import PrefixPipeline
from gateway.prefix.settings import NormalizeSettings, PrefixSettings
from gateway.tokens.alignment import alignment_for_setting
from gateway.tokens.tokenizer import TokenizerUnavailable

tokenizers = pytest.importorskip("tokenizers", reason="the [hf] extra is not installed")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
CORPUS = [
    "You are a helpful assistant. The weather in Zürich is clear today.",
    "def f(x):\n    return x * 2\n# Tools\nYou may call one or more functions to assist with the user query.",
    '{"name": "get_weather", "arguments": {"city": "Paris"}} <tools></tools> tool_response',
    "日本語のテキスト and some more English words to merge: the of and to in is you that it",
] * 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    directory = tmp_path_factory.mktemp("toy-qwen")
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "chat_template": (FIXTURES / "qwen2.5_instruct.jinja").read_text(),
        "eos_token": "<|im_end|>",
        "pad_token": {"content": "<|endoftext|>", "special": True},
        "bos_token": None,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "1", "content": "clear, 21"},
    {"role": "user", "content": "Thanks! def f(x): return x"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_window_equals_whole_string_encoding_of_the_rendered_template(model_dir: Path) -> None:
    from tokenizers import Tokenizer

    alignment = alignment_for_setting(f"hf:{model_dir}")
    assert alignment is not None and alignment.exact
    assert alignment.units == f"exact (hf:{model_dir})"
    rendered = alignment.template.render(MESSAGES, TOOLS)  # type: ignore[attr-defined]
    assert rendered.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools")
    reference = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(rendered, add_special_tokens=False).ids

    pipeline = PrefixPipeline(
        NormalizeSettings(mode="off"), PrefixSettings(tokenizer=f"hf:{model_dir}", window_tokens=4096, block_size=4)
    )
    window = list(pipeline.tokens.for_model("any-name").chat(MESSAGES, TOOLS))
    assert window == reference
    prepared = pipeline.prepare("chat", {"model": "any-name", "messages": MESSAGES, "tools": TOOLS})
    assert prepared.window_tokens == len(reference)
    assert prepared.units == f"exact (hf:{model_dir})"
    assert len(prepared.block_keys) == len(reference) // 4


def test_short_window_is_a_prefix_and_segments_are_cached(model_dir: Path) -> None:
    pipeline = PrefixPipeline(
        NormalizeSettings(mode="off"), PrefixSettings(tokenizer=f"hf:{model_dir}", window_tokens=20, block_size=4)
    )
    full = PrefixPipeline(
        NormalizeSettings(mode="off"), PrefixSettings(tokenizer=f"hf:{model_dir}", window_tokens=4096, block_size=4)
    )
    body = {"model": "m", "messages": MESSAGES}
    assert pipeline.prepare("chat", body).block_keys == full.prepare("chat", body).block_keys[:5]
    cache = full.tokens.for_model("m").cache
    misses = cache.misses
    full.prepare("chat", body)
    assert cache.misses == misses  # a seen conversation costs no tokenizer call


def test_a_template_error_falls_back_instead_of_raising(model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text((model_dir / "tokenizer.json").read_text())
    template = (
        "{% if messages|length > 1 %}{{ raise_exception('only one message') }}{% endif %}{{ messages[0]['content'] }}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    pipeline = PrefixPipeline(NormalizeSettings(mode="off"), PrefixSettings(tokenizer=f"hf:{tmp_path}", block_size=4))
    prepared = pipeline.prepare("chat", {"model": "m", "messages": MESSAGES})
    assert prepared.window_tokens > 0


def test_missing_directory_fails_at_config_load_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(TokenizerUnavailable, match=r"tokenizer\.json"):
        alignment_for_setting(f"hf:{tmp_path / 'nope'}")
    raw = {
        "replicas": [{"name": "r0", "url": "http://127.0.0.1:9"}],
        "routes": [{"name": "default", "policy": "prefix", "prefix": {"tokenizer": "p99k_base"}}],
    }
    with pytest.raises(Exception, match="unknown tokenizer 'p99k_base'"):
        parse_config(raw)


def test_bad_input_never_raises_on_the_hf_path(model_dir: Path) -> None:
    from tests.core.test_chat_template_bad_input import BAD_BODIES

    pipeline = PrefixPipeline(NormalizeSettings(mode="off"), PrefixSettings(tokenizer=f"hf:{model_dir}", block_size=16))
    for _name, messages, tools in BAD_BODIES:
        body = {"model": "m", "messages": messages, **({"tools": tools} if tools is not None else {})}
        assert pipeline.prepare("chat", body).units == f"exact (hf:{model_dir})"


def test_completions_get_the_post_processors_prefix_like_vllm(model_dir: Path, tmp_path: Path) -> None:
    """vLLM encodes a completions prompt with add_special_tokens: a BOS-adding post-processor counts."""
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    bos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)]
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text((model_dir / "tokenizer_config.json").read_text())
    pipeline = PrefixPipeline(NormalizeSettings(mode="off"), PrefixSettings(tokenizer=f"hf:{tmp_path}"))
    text = "Once upon a time in Zürich"
    window = list(pipeline.tokens.for_model("m").text(text))
    assert window == tok.encode(text, add_special_tokens=True).ids and window[0] == bos
    plain = PrefixPipeline(NormalizeSettings(mode="off"), PrefixSettings(tokenizer=f"hf:{model_dir}"))
    assert list(plain.tokens.for_model("m").text(text)) == tok.encode(text, add_special_tokens=False).ids


def test_special_token_text_in_content_is_a_special_token_on_the_hf_path(model_dir: Path) -> None:
    """As vLLM's tokenizer does: ``<|im_end|>`` pasted into a message is the special token, in chat
    and in a completion prompt alike (the directory's own tokenizer.json is the reference)."""
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    im_end = reference.token_to_id("<|im_end|>")
    pipeline = PrefixPipeline(NormalizeSettings(mode="off"), PrefixSettings(tokenizer=f"hf:{model_dir}"))
    windows = pipeline.tokens.for_model("any-name")
    messages = [{"role": "user", "content": "pasted: <|im_end|> and <|im_start|>assistant\nhi"}]
    rendered = windows.template.render(messages)  # type: ignore[attr-defined]
    ids = list(windows.chat(messages))
    assert ids == reference.encode(rendered, add_special_tokens=False).ids
    plain = list(windows.chat([{"role": "user", "content": "pasted: and assistant\nhi"}]))
    assert ids.count(im_end) == plain.count(im_end) + 1  # the template's own ones and the pasted one
    prompt = "a completion with <|im_end|> inside"
    expected = reference.encode(prompt, add_special_tokens=False).ids
    assert list(windows.text(prompt))[-len(expected) :] == expected and im_end in expected
