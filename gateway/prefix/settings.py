"""Per-route settings of the prefix engine (normalization and prefix keying).

Imported by the config schema; every field has a documented default.  Validation happens
here (regexes compile, rule names are metric-label safe, assistant/tool messages can never
be put in scope), so a bad route fails at config load, never on a request.
"""

from __future__ import annotations

import re
from typing import Literal, get_args

from pydantic import BaseModel, Field, field_validator, model_validator

DetectorName = Literal[
    "rfc2822_datetime",
    "iso_datetime",
    "uuid",
    "unix_timestamp",
    "date",
    "time",
    "hex_id",
    "prefixed_id",
    "base64_id",
]
#: Built-in detectors, in priority order (an earlier one wins when two match at the same place).
DETECTORS: tuple[str, ...] = get_args(DetectorName)

_RULE_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


class RegexRule(BaseModel):
    """A route's own volatile-span rule: every match of ``pattern`` is treated like a timestamp."""

    model_config = {"extra": "forbid"}

    name: str = Field(description="metric label and placeholder name: [a-z][a-z0-9_]{0,31}")
    pattern: str = Field(description="Python regular expression; each match (group 0) is one volatile span")
    ignore_case: bool = Field(False, description="compile with re.IGNORECASE")
    always: bool = Field(
        True,
        description="move every match from the first request on (false: only once its value was seen to change, "
        "like the built-in detectors); a route's own rule also moves matches inside code and JSON",
    )

    @field_validator("name")
    @classmethod
    def _name_ok(cls, value: str) -> str:
        if not _RULE_NAME.match(value):
            raise ValueError("rule name must match [a-z][a-z0-9_]{0,31} (it becomes a metric label)")
        if value in DETECTORS:
            raise ValueError(f"rule name {value!r} is a built-in detector; pick another name")
        return value

    @field_validator("pattern")
    @classmethod
    def _pattern_ok(cls, value: str) -> str:
        try:
            compiled = re.compile(value)
        except re.error as exc:
            raise ValueError(f"invalid regular expression: {exc}") from None
        if compiled.match(""):
            raise ValueError("pattern must not match the empty string")
        return value


class LearnSettings(BaseModel):
    """Bounds of the per-route learner of which spans vary (memory and expiry) and what it shows."""

    model_config = {"extra": "forbid"}

    max_places: int = Field(4096, ge=1, description="places (route field + surrounding text) remembered per route")
    expire_s: float = Field(3600.0, gt=0, description="forget a place not seen for this long")
    discover: bool = Field(
        True,
        description="learn volatile spans no rule knows by comparing successive requests (moved in relocate mode)",
    )
    max_discovered: int = Field(32, ge=0, description="discovered spans kept per route")
    examples: Literal["shape", "raw"] = Field(
        "shape",
        description="how /admin/stats and explain show example values: their shape (9999-99-99) or, for "
        "debugging only, the raw text (prompt text in the admin API)",
    )


class NormalizeSettings(BaseModel):
    """How volatile spans (timestamps, ids, ...) in the stable part of a prompt are handled."""

    model_config = {"extra": "forbid"}

    mode: Literal["off", "report", "relocate"] = Field(
        "report", description="off: do nothing; report: count what was found; relocate: move it after the stable prefix"
    )
    detectors: list[DetectorName] = Field(
        default_factory=lambda: list(DETECTORS), description="built-in detectors to run (default: all)"
    )
    rules: list[RegexRule] = Field(default_factory=list, description="extra named regex rules for this route")
    roles: list[Literal["system", "developer", "user"]] = Field(
        default_factory=lambda: ["system", "developer"],
        description="chat message roles whose content is scanned (assistant and tool messages never are)",
    )
    tools: bool = Field(True, description="scan the 'description' strings of tool definitions")
    max_scan_chars: int = Field(
        32768, ge=0, description="chat: scan at most this many characters of in-scope text per request, in order"
    )
    completion_prefix_chars: int = Field(
        2048, ge=0, description="/v1/completions: scan only this many leading characters of a string prompt"
    )
    placement: Literal["end", "last_user", "system_before_last_user", "trailing_system"] = Field(
        "end",
        description="chat: where the relocated values go: end (default: appended to the last message when it is "
        "a user, tool, system or developer message, else a trailing system message: keeps multi-turn and agent "
        "loops cached), appended to the last user message, a system message right before the last user message, "
        "or a system message after the last message",
    )
    completion_placement: Literal["after_span_line", "end"] = Field(
        "end",
        description="completions: append the values block at the very end of the prompt (default), "
        "or insert it after the line holding the last moved span",
    )
    always: list[str] = Field(
        default_factory=list,
        description="built-in detectors (or '*': all) whose spans are moved from the first request on; "
        "the others are moved only once their value was seen to change at the same place",
    )
    learn: LearnSettings = Field(
        default_factory=lambda: LearnSettings(), description="online learning of what varies (bounded, expiring)"
    )
    values_note: str = Field(
        "",
        description="an optional first line inside the appended values block (e.g. 'Current values of the "
        "{{volatile:...}} placeholders above:'); every request pays its tokens after the cached prefix "
        "(that example: 12 Llama 3 tokens), so none by default: the tag and the placeholder = value lines "
        "say what the block is",
    )
    canonicalize_tools: bool = Field(
        False, description="rewrite tool JSON schemas with sorted keys so key order never splits the cache"
    )

    @field_validator("detectors")
    @classmethod
    def _unique_detectors(cls, value: list[str]) -> list[str]:
        return list(dict.fromkeys(value))

    @field_validator("always")
    @classmethod
    def _known_detectors(cls, value: list[str]) -> list[str]:
        unknown = [v for v in value if v != "*" and v not in DETECTORS]
        if unknown:
            raise ValueError(f"unknown detector(s) {unknown}: use '*' or one of {list(DETECTORS)}")
        return value

    @model_validator(mode="after")
    def _unique_rules(self) -> NormalizeSettings:
        names = [r.name for r in self.rules]
        if len(names) != len(set(names)):
            raise ValueError("rule names must be unique")
        return self


class PrefixSettings(BaseModel):
    """How a prompt becomes routing keys: its leading window tokenized and hashed in blocks, the rest in text chunks."""

    model_config = {"extra": "forbid"}

    tokenizer: str = Field(
        "auto",
        description="auto (the served model's vocabulary and chat template, from its name: Llama 3.x, "
        "Qwen2.5/Qwen3; others cl100k_base/o200k_base), cl100k_base, o200k_base, llama3, qwen3, "
        "or hf:/path/to/model_dir (a local Hugging Face model: tokenizer.json + chat_template)",
    )
    window_tokens: int = Field(
        4096,
        ge=16,
        description=(
            "leading tokens tokenized exactly and hashed in blocks; past them the key chain goes on over "
            "the rest of the prompt in text chunks"
        ),
    )
    block_size: int | Literal["auto"] = Field(
        "auto",
        description="tokens per hashed block: auto (the default) follows the replicas' own block size as they "
        "publish it in vllm:cache_config_info (16 until one is known; when they disagree, the largest size every "
        "one of theirs is a multiple of, so each engine's blocks are keyed at it and matched from its KV events; "
        "under 16, the most common, ties to the smallest; stats/explain/doctor name which replicas use which), "
        "or an integer (vLLM's "
        "--block-size; always wins)",
    )
    lora_from_model: bool = Field(
        False,
        description="the request's model name is a LoRA adapter: it goes into the first block's seed as the LoRA",
    )
    base_model: str | None = Field(
        None, description="with lora_from_model: the base model name for the seed (default: the request's model)"
    )
    chunk_bytes: int = Field(
        1024,
        ge=16,
        description="past the token window the key chain continues over the prompt's UTF-8 text in chunks of "
        "this many bytes (each message ends its own chunk): prompts are told apart however deep they differ",
    )
    fork_bytes: int = Field(
        128,
        ge=0,
        description="where a replica whose KV events show it holds the whole window matches past it, the prompts "
        "may part inside a text chunk: each chunk then also carries a print of every this many bytes (a divisor "
        "of chunk_bytes; computed only while a replica publishes events, ~1 µs per KB of prompt past the window), "
        "so predicted cached tokens stop where they part, not at the chunk before (0: chunk resolution)",
    )
    fork_tail_bytes: int = Field(
        65536,
        ge=0,
        description="with fork_bytes: only the chunks ending in the prompt's last this many bytes get prints "
        "(where the next turn, a tool loop's next step or another question on one of the last documents parts; "
        "their cost then stays under ~0.15 ms per prompt however long it is); 0: every chunk past the window",
    )
    token_cache_tokens: int = Field(
        2_000_000,
        ge=0,
        description="bound of the per-route LRU of segment text -> token ids (about 4 bytes per token); 0 disables",
    )
    prompt_anchors: int = Field(
        100_000,
        ge=0,
        description="past the token window, token counts are estimated from text bytes; each reply's exact "
        "usage.prompt_tokens is kept under the prompt's last keys (per route, this many keys at most, ~150 bytes "
        "each; 0 disables), so the next turn of a conversation counts the tokens before its new messages "
        "exactly (predicted cached tokens, prefill work)",
    )

    @model_validator(mode="after")
    def _fork_bytes_divide_chunks(self) -> PrefixSettings:
        if "fork_bytes" in self.model_fields_set and self.fork_bytes and self.chunk_bytes % self.fork_bytes:
            raise ValueError(
                f"fork_bytes ({self.fork_bytes}) must divide chunk_bytes ({self.chunk_bytes}), "
                "or be 0 to turn prints off"
            )
        return self

    @property
    def print_bytes(self) -> int:
        """The fork print piece in effect: ``fork_bytes`` where it divides ``chunk_bytes`` and is
        smaller (the default 128 with a ``chunk_bytes`` it does not divide: none)."""
        size = self.fork_bytes
        return size if 0 < size < self.chunk_bytes and self.chunk_bytes % size == 0 else 0

    @field_validator("block_size", mode="before")
    @classmethod
    def _block_size_ok(cls, value: object) -> int | str:
        from gateway.prefix.block_size import validate_setting as valid_block_size

        return valid_block_size(value)

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_ok(cls, value: str) -> str:
        from gateway.tokens.alignment import validate_setting

        return validate_setting(value)
