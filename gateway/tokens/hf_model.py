"""A local Hugging Face model directory as the gateway's tokenizer and chat template (``hf:DIR``).

For any model the gateway has no built-in renderer for, the directory vLLM serves from holds
the exact truth: ``tokenizer.json`` (loaded with the optional ``tokenizers`` package,
``pip install 'prefix-gateway[hf]'``) and the ``chat_template`` of ``tokenizer_config.json``
(or a ``chat_template.jinja`` next to it).  The template is rendered the way transformers
renders it for vLLM: jinja2's *immutable sandbox* (a template cannot reach Python objects or
mutate its inputs), ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension,
transformers' ``tojson`` and ``raise_exception``/``strftime_now`` helpers, and the special
tokens of ``tokenizer_config.json`` (``bos_token``...) as variables.  Everything is offline.

The rendered string is split at the tokenizer's added tokens (as the tokenizer itself does
before BPE), so each text run is cached and tokenized on its own.  As in the built-in
renderers (:mod:`gateway.tokens.templates`), a special-token look-alike inside message content
is then a special token, as it is for vLLM.  A template error (vLLM would answer 400) falls
back to the generic template: routing must never fail on a request.  A long conversation is rendered only as far as the
token window needs, where the template renders a prefix of the messages as a prefix of the
whole (checked: :mod:`gateway.tokens.prefix_render`).
"""

from __future__ import annotations

import datetime
import json
import re
from array import array
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from gateway.tokens.chat_template import GENERIC, Alignment, SpecialToken, hf_tojson, vllm_messages, vllm_tools
from gateway.tokens.prefix_render import Measure, PrefixRendering
from gateway.tokens.tokenizer import HFTokenizer, TokenizerUnavailable


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as AddedToken dicts."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _chat_template_source(directory: Path, config: Mapping[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the "default" one serves chat
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    if isinstance(template, str):
        return template
    for name in ("chat_template.jinja",):
        path = directory / name
        if path.is_file():
            return path.read_text(encoding="utf-8")
    path = directory / "chat_template.json"
    if path.is_file():
        value = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
        return value if isinstance(value, str) else None
    return None


class JinjaTemplate:
    """A model's own Jinja chat template, rendered in a sandbox; segments split at added tokens."""

    exact = True

    def __init__(self, source: str, tokenizer: HFTokenizer, special_tokens: Mapping[str, str | None]) -> None:
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, **_: hf_tojson(x, indent)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self._template = env.from_string(source)  # a syntax error fails at route build time
        self._variables = dict(special_tokens)
        self.name = "hf-jinja"
        added = tokenizer.special_tokens()  # every added token: the tokenizer splits them out before BPE
        self._specials = {text: SpecialToken(text, token_id) for text, token_id in added.items()}
        self._split = (
            re.compile("(" + "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) + ")")
            if added
            else None
        )
        by_id = {token_id: text for text, token_id in added.items()}
        # /v1/completions: vLLM encodes with add_special_tokens, i.e. the post-processor's prefix
        self.completion_prefix = tuple(SpecialToken(by_id.get(i, ""), i) for i in tokenizer.completion_prefix())

        # the leading messages only, where that renders what the whole would (tokens.prefix_render)
        self.prefixes = (
            PrefixRendering(self._render, self._split, self._specials, vllm_messages) if self._split else None
        )

    def render(self, messages: Sequence[Any], tools: Any = None, add_generation_prompt: bool = True) -> str:
        return self._render(vllm_messages(messages), vllm_tools(tools), add_generation_prompt)

    def _render(self, messages: list[dict[str, Any]], tools: Any, add_generation_prompt: bool) -> str:
        """Render messages and tools already in vLLM's shape."""
        return self._template.render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **self._variables
        )

    def leading_window(
        self, messages: Sequence[Any], tools: Any, window: int, measure: Measure
    ) -> tuple[array[int], float | None] | None:
        """The window's tokens from the leading messages alone, or None: render them all (:meth:`segments`)."""
        if self.prefixes is None or not self.prefixes.stable or len(messages) < 3:
            return None
        return self.prefixes.window(messages, vllm_tools(tools), window, measure)

    def segments(self, messages: Sequence[Any], tools: Any = None, add_generation_prompt: bool = True) -> Iterator[str]:
        try:
            text = self.render(messages, tools, add_generation_prompt)
        except Exception:
            return GENERIC.segments(messages, tools, add_generation_prompt)
        if self._split is None:
            return iter((text,))
        specials = self._specials
        return (specials.get(piece, piece) for piece in self._split.split(text) if piece)


def load_hf_model(path: str) -> Alignment:
    """``path``: a model directory, or its ``tokenizer.json`` (the config is looked up beside it)."""
    target = Path(path).expanduser()
    if target.is_dir():
        directory, tokenizer_file = target, target / "tokenizer.json"
    else:
        directory, tokenizer_file = target.parent, target
    if not tokenizer_file.is_file():
        raise TokenizerUnavailable(
            f"no tokenizer.json at {str(tokenizer_file)!r}: point tokenizer: hf:DIR at the model directory "
            "vLLM serves from (it holds tokenizer.json and tokenizer_config.json)"
        )
    tokenizer = HFTokenizer(str(tokenizer_file))
    config_file = directory / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if config_file.is_file():
        try:
            loaded = json.loads(config_file.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise TokenizerUnavailable(f"{config_file} is not valid JSON: {exc}") from None
        config = loaded if isinstance(loaded, dict) else {}
    source = _chat_template_source(directory, config)
    vocab = f"hf:{directory}"
    if source is None:  # no chat template: chat requests get the generic one (approximate)
        return Alignment(f"{vocab}/generic", vocab, tokenizer, GENERIC)
    names = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
    special = {name: _token_text(config.get(name)) for name in names}
    try:
        template = JinjaTemplate(source, tokenizer, special)
    except Exception as exc:
        raise TokenizerUnavailable(f"the chat_template of {directory} does not compile: {exc}") from None
    return Alignment(f"{vocab}/jinja", vocab, tokenizer, template)
