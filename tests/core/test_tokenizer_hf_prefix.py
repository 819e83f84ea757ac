"""``hf:DIR`` templates render a long conversation only as far as the token window needs, with the
same window (and keys) as rendering it whole; templates whose prefixes render differently are
rendered whole (found at load, or on a checked live request)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from gateway.config import NormalizeSettings, PrefixSettings
from gateway.prefix.pipeline import PrefixPipeline
from gateway.tokens.alignment import alignment_for_setting
from gateway.tokens.prefix_render import VERIFY_FIRST
from gateway.tokens.window import WindowTokenizer

tokenizers = pytest.importorskip("tokenizers", reason="the [hf] extra is not installed")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
WORDS = ["the", "of", "and", "to", "in", "is", "you", "that", "it", "weather", "Zürich", "def", "日本語", "tools"]
TEMPLATES = {
    "qwen2.5": ("qwen2.5_instruct.jinja", ["<|im_end|>", "<|im_start|>", "<|endoftext|>"]),
    "qwen3": ("qwen3.jinja", ["<|im_end|>", "<|im_start|>", "<|endoftext|>", "<think>", "</think>"]),
    "llama3.1": ("llama3.1_instruct.jinja", ["<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]),
}
CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def _model_dir(root: Path, template: str, specials: list[str]) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainer)
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    config = {"chat_template": template, "eos_token": specials[0], "bos_token": None}
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


def _conversation(turns: int, seed: int = 1) -> list[dict[str, Any]]:
    rnd = random.Random(seed)

    def text(n: int) -> str:
        return " ".join(rnd.choice(WORDS) for _ in range(n))

    messages: list[dict[str, Any]] = [{"role": "system", "content": text(40)}]
    for i in range(turns):
        messages.append({"role": "user", "content": text(30)})
        reasoning = {"reasoning_content": text(5)} if i % 3 == 0 else {}
        messages.append({"role": "assistant", "content": text(40), **reasoning})
    messages.append({"role": "user", "content": [{"type": "text", "text": text(10)}]})
    return messages


class _Counting:
    """Wraps a compiled template: how many messages each render got."""

    def __init__(self, template: Any) -> None:
        self._template = template
        self.sizes: list[int] = []

    def render(self, **kwargs: Any) -> str:
        self.sizes.append(len(kwargs["messages"]))
        return self._template.render(**kwargs)  # type: ignore[no-any-return]


def _whole(wt: WindowTokenizer, messages: list[dict[str, Any]]) -> tuple[list[int], float | None]:
    ids, ratio = wt.measured(wt.template.segments(messages, None))
    return list(ids), ratio


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_a_long_conversation_renders_only_the_messages_the_window_needs(name: str, tmp_path: Path) -> None:
    file, specials = TEMPLATES[name]
    directory = _model_dir(tmp_path / name, (FIXTURES / file).read_text(), specials)
    alignment = alignment_for_setting(f"hf:{directory}")
    template = alignment.template
    assert template.prefixes is not None and template.prefixes.stable  # type: ignore[attr-defined]
    counting = _Counting(template._template)  # type: ignore[attr-defined]
    template._template = counting  # type: ignore[attr-defined]
    wt = WindowTokenizer(alignment.tokenizer, 512, 100_000, template)
    for seed in range(VERIFY_FIRST + 2):  # the first ones are checked against the whole rendering too
        messages = _conversation(150, seed)
        counting.sizes.clear()
        ids, ratio = wt.chat_measured(messages)
        assert (list(ids), ratio) == _whole(wt, messages)  # the same window, token for token
        assert len(ids) == 512
    last = counting.sizes[:-1]  # (the last render is _whole's)
    assert last and max(last) < len(messages) // 4  # an unchecked request rendered a small prefix only
    assert template.prefixes.mismatches == 0  # type: ignore[attr-defined]
    # the pipeline keys it as rendering it whole does
    pipeline = PrefixPipeline(
        NormalizeSettings(mode="off"), PrefixSettings(tokenizer=f"hf:{directory}", window_tokens=512, block_size=4)
    )
    body = {"model": "m", "messages": _conversation(150, 99)}
    whole = pipeline.tokens.for_model("m").template
    whole.prefixes.stable = False  # type: ignore[attr-defined]
    slow = pipeline.prepare("chat", body, learn=False)
    whole.prefixes.stable = True  # type: ignore[attr-defined]
    assert pipeline.prepare("chat", body, learn=False).keys == slow.keys


def test_a_short_conversation_renders_once(tmp_path: Path) -> None:
    directory = _model_dir(tmp_path / "chatml", CHATML, ["<|im_end|>", "<|im_start|>"])
    alignment = alignment_for_setting(f"hf:{directory}")
    counting = _Counting(alignment.template._template)  # type: ignore[attr-defined]
    alignment.template._template = counting  # type: ignore[attr-defined]
    wt = WindowTokenizer(alignment.tokenizer, 4096, 100_000, alignment.template)
    messages = _conversation(3)
    assert list(wt.chat(messages)) == _whole(wt, messages)[0]
    assert counting.sizes[0] == len(messages) and alignment.template.prefixes.served == 0  # type: ignore[attr-defined]


def test_a_template_whose_prefixes_render_differently_is_rendered_whole(tmp_path: Path) -> None:
    counts_messages = "{{ messages|length }}<|im_end|>" + CHATML  # the first line depends on the last message
    directory = _model_dir(tmp_path / "counts", counts_messages, ["<|im_end|>", "<|im_start|>"])
    alignment = alignment_for_setting(f"hf:{directory}")
    assert not alignment.template.prefixes.stable  # type: ignore[attr-defined]
    wt = WindowTokenizer(alignment.tokenizer, 256, 100_000, alignment.template)
    messages = _conversation(100)
    assert list(wt.chat(messages)) == _whole(wt, messages)[0]


def test_a_live_mismatch_turns_prefix_rendering_off_and_that_request_renders_whole(tmp_path: Path) -> None:
    # a branch no probe takes: the last message's content changes the first line
    switch = "{% if messages[-1].content == 'SWITCH' %}switched<|im_end|>{% endif %}" + CHATML
    directory = _model_dir(tmp_path / "switch", switch, ["<|im_end|>", "<|im_start|>"])
    alignment = alignment_for_setting(f"hf:{directory}")
    prefixes = alignment.template.prefixes  # type: ignore[attr-defined]
    assert prefixes.stable
    wt = WindowTokenizer(alignment.tokenizer, 256, 100_000, alignment.template)
    assert list(wt.chat(_conversation(100))) == _whole(wt, _conversation(100))[0] and prefixes.served == 1
    messages = [*_conversation(100), {"role": "user", "content": "SWITCH"}]
    assert list(wt.chat(messages)) == _whole(wt, messages)[0]
    assert (prefixes.mismatches, prefixes.stable) == (1, False)


def test_a_template_no_probe_can_render_is_rendered_whole(tmp_path: Path) -> None:
    refuses = "{{ raise_exception('this template takes no such conversation') }}"
    directory = _model_dir(tmp_path / "refuses", refuses, ["<|im_end|>", "<|im_start|>"])
    assert not alignment_for_setting(f"hf:{directory}").template.prefixes.stable  # type: ignore[attr-defined]
