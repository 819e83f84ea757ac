"""Per-route settings of the prefix engine (normalization and prefix keying).

Imported by the config schema; every field has a documented default.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class NormalizeSettings(BaseModel):
    """How volatile spans (timestamps, ids, ...) in the stable part of a prompt are handled."""

    model_config = {"extra": "forbid"}

    mode: Literal["off", "report", "relocate"] = Field(
        "report", description="off: do nothing; report: count what was found; relocate: move it after the stable prefix"
    )


class PrefixSettings(BaseModel):
    """How the leading window of a prompt is tokenized and hashed into routing keys."""

    model_config = {"extra": "forbid"}

    tokenizer: str = Field("cl100k_base", description="cl100k_base, o200k_base, or a path to a tokenizer.json")
    window_tokens: int = Field(4096, ge=16, description="only this many leading tokens are tokenized and hashed")
    block_size: int = Field(16, ge=1, description="tokens per hashed block (vLLM's default is 16)")
