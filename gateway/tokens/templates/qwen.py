"""Qwen2.5 and Qwen3 chat templates (ChatML with a tools block), in Python.

Rebuilt from the ``chat_template`` of Qwen/Qwen2.5-7B-Instruct and Qwen/Qwen3-8B:

- ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message; Qwen2.5 adds its default system
  prompt ("You are Qwen, created by Alibaba Cloud. ...") when the first message is not one.
- with ``tools``: a system message with the schemas (``tojson``, one per line) inside
  ``<tools></tools>`` and the ``<tool_call>`` instructions (``<tool_call>`` is a special token);
- assistant tool calls as ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``;
- consecutive tool results merge into one user turn of ``<tool_response>`` blocks
  (special tokens in Qwen3's vocabulary, plain text in Qwen2.5's);
- Qwen3 only: reasoning (``<think>``) is kept only for assistant turns after the last real
  user query, and only when they are the last message or carry reasoning: history turns
  are re-rendered without it, as the published template does.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from gateway.tokens.chat_template import hf_tojson, vllm_content, vllm_message, vllm_tools
from gateway.tokens.templates import Runs, special_tokens
from gateway.tokens.tokenizer import Tokenizer

_QWEN25_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
_TOOLS_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n"
)
_BASE = ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")
_QWEN3_EXTRA = ("<tool_response>", "</tool_response>", "<think>", "</think>")


class QwenTemplate:
    """``version`` "2.5" or "3"; ``exact`` because tests compare with the published templates."""

    exact = True

    def __init__(self, tokenizer: Tokenizer, version: str = "3") -> None:
        if version not in ("2.5", "3"):
            raise ValueError(f"unknown Qwen template version {version!r}")
        self.version = version
        self.name = f"qwen{version}"
        names = _BASE + (_QWEN3_EXTRA if version == "3" else ())
        self._specials, self._split = special_tokens(tokenizer, names)
        # a /v1/completions prompt: special-token text in it is parsed as vLLM does
        self.split_text = self._split.pieces

    def render(self, messages: Sequence[Any], tools: Any = None, add_generation_prompt: bool = True) -> list[str]:
        return list(self.segments(messages, tools, add_generation_prompt))

    def segments(self, messages: Sequence[Any], tools: Any = None, add_generation_prompt: bool = True) -> Iterator[str]:
        """Lazily, message by message (a consumer that stops early never renders the rest)."""
        valid: list[Any] = []
        roles: list[str] = []
        for m in messages:  # one cheap pass over the whole conversation: roles only
            if type(m) is dict or isinstance(m, Mapping):
                valid.append(m)
                role = m.get("role")
                roles.append(role if type(role) is str else "user")
        tool_list = vllm_tools(tools)
        qwen3 = self.version == "3"
        r = Runs(self._split)
        first = vllm_message(valid[0]) if valid else None
        has_system = first is not None and first["role"] == "system"
        if tool_list:
            r.lit("<|im_start|>system\n")
            if first is not None and has_system:
                r.text(first["content"] + ("\n\n" if qwen3 else ""))
            elif not qwen3:
                r.lit(_QWEN25_SYSTEM)
            r.lit(_TOOLS_HEAD if qwen3 else "\n\n" + _TOOLS_HEAD)
            for tool in tool_list:
                r.lit("\n")
                r.text(hf_tojson(tool))
            r.lit(_TOOLS_TAIL)
        elif first is not None and has_system:
            r.lit("<|im_start|>system\n")
            r.text(first["content"])
            r.lit("<|im_end|>\n")
        elif not qwen3:
            r.lit("<|im_start|>system\n" + _QWEN25_SYSTEM + "<|im_end|>\n")
        yield from r.drain()
        last_query = _last_query_index(valid, roles) if qwen3 else -1
        n = len(valid)
        for i, raw in enumerate(valid):
            role = roles[i]
            if role == "system" and i == 0:
                continue  # rendered above
            m = first if i == 0 and first is not None else vllm_message(raw)
            if m is None:
                continue
            content = m["content"]
            plain_assistant = not qwen3 and role == "assistant" and not m.get("tool_calls")
            if role == "user" or role == "system" or plain_assistant:
                r.lit("<|im_start|>")
                r.text(role + "\n" + content)
                r.lit("<|im_end|>\n")
            elif role == "assistant":
                if qwen3:
                    self._qwen3_assistant(r, m, i, n, last_query)
                else:
                    self._qwen25_assistant(r, m)
            elif role == "tool":
                if i == 0 or roles[i - 1] != "tool":
                    r.lit("<|im_start|>user")
                r.lit("\n<tool_response>\n")
                r.text(content)
                r.lit("\n</tool_response>")
                if i == n - 1 or roles[i + 1] != "tool":
                    r.lit("<|im_end|>\n")
            yield from r.drain()
        if add_generation_prompt:
            r.lit("<|im_start|>assistant\n")
        yield from r.finish()

    @staticmethod
    def _qwen25_assistant(r: Runs, m: dict[str, Any]) -> None:
        r.lit("<|im_start|>")
        r.text("assistant")
        if m["content"]:
            r.text("\n" + m["content"])
        for call in m.get("tool_calls") or ():
            function = call["function"]
            r.lit("\n<tool_call>\n")
            r.text('{"name": "' + function["name"] + '", "arguments": ' + hf_tojson(function.get("arguments")))
            r.lit("}\n</tool_call>")
        r.lit("<|im_end|>\n")

    @staticmethod
    def _qwen3_assistant(r: Runs, m: dict[str, Any], i: int, n: int, last_query: int) -> None:
        content: str = m["content"]
        reasoning = m.get("reasoning_content")
        if not isinstance(reasoning, str):
            reasoning = ""
            if "</think>" in content:
                reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                content = content.split("</think>")[-1].lstrip("\n")
        r.lit("<|im_start|>")
        if i > last_query and (i == n - 1 or reasoning):
            r.text("assistant\n")
            r.lit("<think>\n")
            r.text(reasoning.strip("\n"))
            r.lit("\n</think>\n\n")
            r.text(content.lstrip("\n"))
        else:
            r.text("assistant\n" + content)
        for k, call in enumerate(m.get("tool_calls") or ()):
            if (k == 0 and content) or k > 0:
                r.text("\n")
            function = call["function"]
            args = function.get("arguments")
            r.lit("<tool_call>\n")
            r.text('{"name": "' + function["name"] + '", "arguments": ')
            r.text(args if isinstance(args, str) else hf_tojson(args))
            r.lit("}\n</tool_call>")
        r.lit("<|im_end|>\n")


def _last_query_index(valid: list[Any], roles: list[str]) -> int:
    """Qwen3's ``ns.last_query_index``: the last user message that is not a wrapped tool response."""
    for index in range(len(valid) - 1, -1, -1):
        if roles[index] == "user":
            c = vllm_content(valid[index].get("content"))
            if not (c.startswith("<tool_response>") and c.endswith("</tool_response>")):
                return index
    return len(valid) - 1
