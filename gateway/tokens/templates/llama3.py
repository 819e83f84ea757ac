"""Meta's Llama 3.1 / 3.3 Instruct chat template (``tokenizer_config.json``), in Python.

Rebuilt statement by statement from the published Jinja template (the same text for
Llama-3.1-8B/70B-Instruct and Llama-3.3-70B-Instruct): the system header always carries
"Cutting Knowledge Date: December 2023" and "Today Date: 26 Jul 2024" (the template's
default ``date_string``); with ``tools``, "Environment: ipython" goes into the system header
and the tool schemas (``tojson(indent=4)``) into the *first user message*; an assistant tool
call renders as ``{"name": ..., "parameters": ...}``; a tool result renders under the
``ipython`` role as JSON (a string content is JSON-quoted: Jinja finds strings iterable).

Segments are generated lazily, message by message: the window tokenizer stops pulling once
its window is full, so a long history past the window is never rendered.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from gateway.tokens.chat_template import hf_tojson, vllm_message, vllm_tools
from gateway.tokens.templates import Runs, special_tokens
from gateway.tokens.tokenizer import Tokenizer

_TOOLS_PREAMBLE = (
    "Given the following functions, please respond with a JSON for a function call "
    "with its proper arguments that best answers the given prompt.\n\n"
    'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
    "Do not use variables.\n\n"
)


class Llama31Template:
    """Llama 3.1 / 3.3 Instruct; ``exact`` because tests compare it with the published template."""

    exact = True

    def __init__(self, tokenizer: Tokenizer, date_string: str = "26 Jul 2024", name: str = "llama3.1") -> None:
        self.name = name
        self.date_string = date_string
        self._specials, self._split = special_tokens(
            tokenizer, ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
        )
        # vLLM tokenizes a /v1/completions prompt with add_special_tokens: Llama gets its BOS
        self.completion_prefix = (self._specials["<|begin_of_text|>"],)
        # a /v1/completions prompt: special-token text in it is parsed as vLLM does
        self.split_text = self._split.pieces

    def render(self, messages: Sequence[Any], tools: Any = None, add_generation_prompt: bool = True) -> list[str]:
        return list(self.segments(messages, tools, add_generation_prompt))

    def segments(self, messages: Sequence[Any], tools: Any = None, add_generation_prompt: bool = True) -> Iterator[str]:
        tool_list = vllm_tools(tools)
        views = (v for v in map(vllm_message, messages) if v is not None)
        first = next(views, None)
        r = Runs(self._split)
        r.lit("<|begin_of_text|>")
        system = ""
        if first is not None and first["role"] == "system":
            system = first["content"].strip()
            first = None
        r.lit("<|start_header_id|>system<|end_header_id|>\n\n")
        if tool_list is not None:
            r.lit("Environment: ipython\n")
        r.lit("Cutting Knowledge Date: December 2023\n")
        r.lit("Today Date: " + self.date_string + "\n\n")
        r.text(system)
        r.lit("<|eot_id|>")
        yield from r.drain()
        if tool_list is not None:
            user = first if first is not None else next(views, None)
            first = None
            r.lit("<|start_header_id|>user<|end_header_id|>\n\n")  # (no user message: vLLM answers 400)
            r.lit(_TOOLS_PREAMBLE)
            for tool in tool_list:
                r.text(hf_tojson(tool, indent=4))
                r.lit("\n\n")
            r.text(user["content"].strip() if user is not None else "")
            r.lit("<|eot_id|>")
            yield from r.drain()
        if first is not None:
            self._message(r, first)
            yield from r.drain()
        for m in views:
            self._message(r, m)
            yield from r.drain()
        if add_generation_prompt:
            r.lit("<|start_header_id|>assistant<|end_header_id|>\n\n")
        yield from r.finish()

    @staticmethod
    def _message(r: Runs, m: dict[str, Any]) -> None:
        role = m["role"]
        if not (role in ("ipython", "tool") or "tool_calls" in m):
            r.lit("<|start_header_id|>")
            r.text(role)
            r.lit("<|end_header_id|>\n\n")
            r.text(m["content"].strip())
            r.lit("<|eot_id|>")
        elif "tool_calls" in m:
            r.lit("<|start_header_id|>assistant<|end_header_id|>\n\n")
            calls = m["tool_calls"]
            if calls:  # (more than one call makes the template raise: vLLM answers 400)
                function = calls[0]["function"]
                r.text('{"name": "' + function["name"] + '", ')
                r.text('"parameters": ')
                r.text(hf_tojson(function.get("arguments")))
                r.text("}")
            r.lit("<|eot_id|>")
        else:
            r.lit("<|start_header_id|>ipython<|end_header_id|>\n\n")
            r.text(hf_tojson(m["content"]))
            r.lit("<|eot_id|>")
