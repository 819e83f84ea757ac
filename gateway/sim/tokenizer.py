"""The simulator's own tokenizer and chat rendering, independent of the gateway's.

A replica must behave like a vLLM engine serving its model, not like the gateway: if both
used the same code, no test could notice the gateway predicting the wrong tokens.  So this
module never imports ``gateway.tokens.tokenizer``, ``gateway.tokens.chat_template`` or the gateway's block
hashing.  It loads vocabularies straight from ``quicktok`` (or a ``tokenizer.json`` with the
``tokenizers`` package) and renders chat the way vLLM does:

- ``llama3``: the published Llama 3.1 Instruct Jinja template; ``qwen3``: Qwen3's
  (``templates/``), rendered in jinja2's sandbox like transformers, then the *whole string*
  is tokenized with special tokens parsed (vLLM's tokenizer does that, also inside message
  content).  Completions prompts get Llama's ``<|begin_of_text|>`` as vLLM adds it.
- ``cl100k_base`` / ``o200k_base``: no model template exists; a ChatML-like layout with each
  message tokenized on its own (the convention the project used before model alignment).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

TEMPLATES = Path(__file__).resolve().parent / "templates"
_JINJA = {"llama3": "llama3.jinja", "qwen3": "qwen3.jinja"}
_BOS = {"llama3": "<|begin_of_text|>"}
_TEMPLATE_TOKENS = {
    "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "qwen3": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
}


class SimTokenizerError(RuntimeError):
    """The replica cannot load its tokenizer (it exits at startup with this message)."""


class SimTokenizer:
    """encode (special strings are text), encode_prompt (specials parsed, as vLLM), decode."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name.endswith(".json") or "/" in name:
            self._load_hf(name)
            return
        try:
            import quicktok  # type: ignore[import-untyped]

            enc = quicktok.get_encoding(name)
        except (ImportError, RuntimeError, ValueError, OSError) as exc:
            raise SimTokenizerError(
                f"simulator tokenizer {name!r} is not available: use cl100k_base, o200k_base, llama3, qwen3 "
                f"(bundled in quicktok-v1) or a tokenizer.json path ({exc})"
            ) from None
        self._ordinary = enc.encode_ordinary
        self._decode = enc.decode
        self.specials = {t: enc.encode_single_token(t) for t in enc.special_tokens_set}
        if name == "llama3":  # a Llama 3.1+ engine's tokenizer names three reserved slots (its tool tokens)
            self.specials.update({"<|finetune_right_pad_id|>": 128004, "<|eom_id|>": 128008, "<|python_tag|>": 128010})

    def _load_hf(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise SimTokenizerError(f"tokenizer {path!r} needs the 'tokenizers' package") from None
        if not Path(path).is_file():
            raise SimTokenizerError(f"tokenizer file {path!r} does not exist")
        tok = Tokenizer.from_file(path)
        self._ordinary = lambda text: tok.encode(text, add_special_tokens=False).ids
        self._decode = lambda ids: tok.decode(ids, skip_special_tokens=False)
        self.specials = {}  # the HF tokenizer splits its added tokens itself

    def encode(self, text: str) -> list[int]:
        try:
            return self._ordinary(text)
        except (TypeError, UnicodeEncodeError):  # lone surrogates from JSON escapes
            return self._ordinary(text.encode("utf-16", "surrogatepass").decode("utf-16", "replace"))

    def decode(self, tokens: list[int]) -> str:
        return self._decode(list(tokens))


class PromptBuilder:
    """Chat messages / completion text → prompt token ids, as the replica's vLLM would."""

    def __init__(self, tokenizer: SimTokenizer, encode: Callable[[str], list[int]]) -> None:
        self.tokenizer = tokenizer
        self._encode = encode  # the (caching) ordinary encoder
        self.family = tokenizer.name if tokenizer.name in _JINJA else None
        specials = tokenizer.specials
        self._special_re = (
            re.compile("(" + "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")")
            if specials
            else None
        )
        self._bracketed = bool(specials) and all(_is_bracketed(s) for s in specials)
        self._template = _compiled(self.family) if self.family else None
        bos = _BOS.get(tokenizer.name)
        self._bos = [specials[bos]] if bos and bos in specials else []

    def with_specials(self, text: str) -> list[int]:
        """Tokenize a whole string with special tokens parsed (split first, then BPE per run).

        The specials are found by the alternation of all of them (longest first) or, when
        every special is ``<...>`` with no other ``<`` or ``>`` (all bundled vocabularies) and
        the text has few ``<``, by the spans ``<[^<>]*>`` and a dict lookup: a special that
        starts at a ``<`` can only end at the next ``>``, so those spans are the only
        candidates, and no special can start inside one that is not one (it has no ``<``).
        The alternation tries every special (259 for llama3) at each ``<|``, which made
        splitting a rendered chat cost more than its BPE; the spans loop in Python, which
        costs more past :data:`_BRACKETED_MAX` ``<`` (markup, code).
        """
        if self._special_re is None:
            return self._encode(text)
        bracketed = self._bracketed and text.count("<") <= _BRACKETED_MAX
        candidates = (_BRACKETED if bracketed else self._special_re).finditer(text)
        specials = self.tokenizer.specials
        encode = self._encode
        out: list[int] = []
        pos = 0
        for match in candidates:
            special = specials.get(match.group())
            if special is None:
                continue
            start = match.start()
            if start > pos:
                out.extend(encode(text[pos:start]))
            out.append(special)
            pos = match.end()
        if pos < len(text):
            out.extend(encode(text[pos:]))
        return out

    def completion(self, text: str) -> list[int]:
        """A /v1/completions string prompt: vLLM adds the model's BOS and parses specials."""
        if self.family is None or not text:  # (an empty prompt stays empty: a 400)
            return self._encode(text)
        return self._bos + self.with_specials(text)

    def chat(
        self, messages: Sequence[Mapping[str, Any]], tools: Any = None, add_generation_prompt: bool = True
    ) -> list[int]:
        if self._template is None:
            return self._chatml(messages, tools, add_generation_prompt)
        try:
            text = self._template.render(
                messages=_as_vllm(messages),
                tools=_tools_as_vllm(tools),
                add_generation_prompt=add_generation_prompt,
                **_TEMPLATE_TOKENS[self.family or ""],
            )
        except Exception as exc:  # the template rejects the conversation: vLLM answers 400
            from gateway.sim.protocol import APIError

            raise APIError(400, f"chat template error: {type(exc).__name__}: {exc}"[:500], param="messages") from None
        return self.with_specials(text)

    def _chatml(self, messages: Sequence[Mapping[str, Any]], tools: Any, add_generation_prompt: bool) -> list[int]:
        """One segment per message: ``<|im_start|>role[ name=N]\\ncontent[tool_calls]<|im_end|>\\n``."""
        encode = self._encode
        out: list[int] = []
        if tools:
            out += encode("<|im_start|>tools\n" + _compact(tools) + "<|im_end|>\n")
        for m in messages:
            name = m.get("name")
            head = f"<|im_start|>{m.get('role', 'user')}" + (f" name={name}" if isinstance(name, str) and name else "")
            body = _flatten(m.get("content"))
            if m.get("tool_calls"):
                body += _compact(m.get("tool_calls"))
            out += encode(f"{head}\n{body}<|im_end|>\n")
        if add_generation_prompt:
            out += encode("<|im_start|>assistant\n")
        return out


@cache
def _compiled(family: str) -> Any:
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    template = env.from_string((TEMPLATES / _JINJA[family]).read_text(encoding="utf-8"))
    # jinja2 keeps a template's globals as a ChainMap over the environment's, and copies it
    # into a dict on every render (Python-level iteration: ~40% of rendering a short chat).
    # Nothing changes this private environment's globals after this point: a flat copy is the same.
    template.globals = dict(template.globals)
    return template


_BRACKETED = re.compile(r"<[^<>]*>")
# past this many "<" (markup, code) the candidates' Python loop costs more than the alternation's
# C scan: 18 kB of HTML (1,660 "<") split 2.3x slower by candidates (492 against 211 us)
_BRACKETED_MAX = 64


def _is_bracketed(special: str) -> bool:
    return (
        len(special) >= 2
        and special[0] == "<"
        and special[-1] == ">"
        and "<" not in special[1:]
        and ">" not in special[:-1]
    )


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _flatten(content: Any) -> str:
    """The ChatML layout's content: text parts concatenated, other parts as ``<|type|>url``."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    out = []
    for part in content:
        if isinstance(part, str):
            out.append(part)
        elif isinstance(part, Mapping):
            kind = part.get("type", "text")
            if kind == "text":
                out.append(part.get("text") if isinstance(part.get("text"), str) else "")
            else:
                payload = part.get(kind)
                if isinstance(payload, Mapping):
                    payload = payload.get("url") or payload.get("data") or ""
                out.append(f"<|{kind}|>" + (payload if isinstance(payload, str) else ""))
    return "".join(out)


def _as_vllm(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """What vLLM's chat parser hands a string-format template: text parts joined by newlines,
    tool-call arguments decoded from JSON (vLLM does this before rendering)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for p in content:
                if isinstance(p, Mapping) and p.get("type", "text") == "text" and isinstance(p.get("text"), str):
                    texts.append(p["text"])
                elif isinstance(p, Mapping) and isinstance(p.get("type"), str):
                    payload = p.get(p["type"])
                    if isinstance(payload, Mapping):
                        payload = payload.get("url") or payload.get("data")
                    texts.append(f"<|{p['type']}|>{payload}" if isinstance(payload, str) else f"<|{p['type']}|>")
            content = "\n".join(texts)
        elif not isinstance(content, str):
            content = ""
        item: dict[str, Any] = {"role": m.get("role"), "content": content}
        calls = m.get("tool_calls")
        if calls is not None and m.get("role") == "assistant" and isinstance(calls, list):
            fixed = []
            for call in calls:
                if not isinstance(call, Mapping):
                    continue
                fn = dict(call.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):
                    with contextlib.suppress(ValueError):  # vLLM rejects it; render the text
                        fn["arguments"] = json.loads(args) if args else {}
                elif args is None:
                    fn["arguments"] = {}
                fn.setdefault("name", "")
                fixed.append({**call, "function": fn})
            item["tool_calls"] = fixed
        for key in ("tool_call_id", "name", "reasoning_content"):
            if isinstance(m.get(key), str):
                item[key] = m[key]
        out.append(item)
    return out


def _tools_as_vllm(tools: Any) -> list[dict[str, Any]] | None:
    """vLLM passes its pydantic model_dump of each tool: declared fields first, nulls kept."""
    if not tools:
        return None
    out = []
    for tool in tools:
        if not isinstance(tool, Mapping):
            continue
        fn = tool.get("function") if isinstance(tool.get("function"), Mapping) else {}
        dumped = {"name": fn.get("name"), "description": fn.get("description"), "parameters": fn.get("parameters")}
        dumped.update({k: v for k, v in fn.items() if k not in dumped})
        entry = {"type": tool.get("type", "function"), "function": dumped}
        entry.update({k: v for k, v in tool.items() if k not in entry})
        out.append(entry)
    return out or None
