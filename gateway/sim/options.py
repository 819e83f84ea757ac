"""Every knob of one simulated replica, validated once (pydantic), named like vLLM's flags.

The same names (with underscores) are the CLI flags (with dashes), the keyword options of
:func:`gateway.sim.launcher.run_replicas`, and the JSON a replica process receives.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gateway.sim import DEFAULT_MODEL
from gateway.sim.faults import FAULT_FIELDS, FaultSettings
from gateway.sim.kvevents import KVEventsConfig, parse_kv_events_config


class SimOptions(BaseModel):
    """Configuration of one replica.  Defaults sketch an 8B-class model on one modern GPU."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    model: str = Field(DEFAULT_MODEL, min_length=1, alias="served_model_name")
    # The replica's own vocabulary and chat template (gateway/sim/tokenizer.py).  llama3 by
    # default: deliberately not the gateway's fallback (cl100k_base), so a gateway that does not
    # align with the served model shows it.  cl100k_base / o200k_base: ChatML-like layout.
    tokenizer: str = "llama3"
    lora_modules: tuple[str, ...] = ()

    # KV cache and scheduler (vLLM names and defaults where vLLM has them)
    block_size: int = Field(16, gt=0)
    num_gpu_blocks: int = Field(8192, gt=0)
    max_num_seqs: int = Field(256, gt=0)
    max_num_batched_tokens: int = Field(8192, gt=0)
    max_model_len: int = Field(32768, gt=0)

    # timing model
    prefill_tokens_per_s: float = Field(20000.0, gt=0)
    decode_ms_per_token: float = Field(10.0, ge=0)
    time_scale: float = Field(1.0, ge=0)
    max_output_tokens: int = Field(16, gt=0)

    # KV cache events (vLLM's --kv-events-config JSON, gateway.sim.kvevents)
    kv_events_config: KVEventsConfig | None = None
    # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES: hashes as unsigned 64-bit ints (vLLM's default) or raw digests
    kv_events_int_hashes: bool = True
    # "map": vLLM 0.32's tagged maps; "array": the positional arrays of vLLM before mid-2026
    kv_events_layout: Literal["map", "array"] = "map"

    # "cuda" says "GPU KV cache usage" in the engine log line, "cpu" says "CPU KV cache usage"
    # (vLLM's CPU backend); nothing else changes
    device: Literal["cuda", "cpu"] = "cuda"

    # output and API behaviour
    seed: int = 0
    # Per output token, the chance that the reply's token ids are not the ones its text
    # encodes back to (a word emitted as two pieces), as real models' replies often are: the
    # next chat turn then misses the cache from that block on.  0 = replies re-tokenize exactly.
    retokenize_drift: float = Field(0.02, ge=0.0, le=1.0)
    enable_prompt_tokens_details: bool = True
    # vLLM's --enable-auto-tool-choice with a --tool-call-parser: requests with tools are served;
    # off, vLLM's 400 for tool_choice "auto" (the default when tools are sent) or "required"
    enable_auto_tool_choice: bool = True
    embedding_dim: int = Field(32, gt=0, le=4096)
    metrics_naming: Literal["current", "legacy", "both"] = "current"

    # logs and admin
    log_stats_interval: float = Field(10.0, ge=0)
    disable_log_stats: bool = False
    disable_uvicorn_access_log: bool = False
    enable_admin: bool = False

    # faults (see gateway.sim.faults)
    error_rate: float = Field(0.0, ge=0.0, le=1.0)
    error_status: int = Field(503, ge=400, le=599)
    extra_latency_ms: float = Field(0.0, ge=0.0)
    stall_after_chunks: int | None = Field(None, ge=0)
    drop_after_chunks: int | None = Field(None, ge=0)

    @field_validator("kv_events_config", mode="before")
    @classmethod
    def _kv_events_json(cls, value: Any) -> Any:
        return parse_kv_events_config(value) if isinstance(value, str) else value

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _split_lora(cls, value: Any) -> Any:
        # ``--lora-modules a b`` or vLLM's ``name=path`` form: only the name matters here.
        if isinstance(value, str):
            value = value.split(",") if value else []
        if isinstance(value, list | tuple):
            return tuple(str(v).split("=", 1)[0] for v in value if str(v))
        return value

    def faults(self) -> FaultSettings:
        return FaultSettings(**{name: getattr(self, name) for name in FAULT_FIELDS})

    @property
    def usable_gpu_blocks(self) -> int:
        """vLLM keeps one of its ``num_gpu_blocks`` as the null block: one fewer holds tokens."""
        return max(self.num_gpu_blocks - 1, 1)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.usable_gpu_blocks * self.block_size

    @property
    def effective_max_model_len(self) -> int:
        """vLLM refuses to start when one sequence cannot fit in the KV cache; we clamp instead."""
        return min(self.max_model_len, self.kv_capacity_tokens)

    def served_models(self) -> tuple[str, ...]:
        return (self.model, *self.lora_modules)


OPTION_NAMES = tuple(SimOptions.model_fields)


def build_options(values: Mapping[str, Any] | SimOptions | None = None, **overrides: Any) -> SimOptions:
    """Validate a mapping (plus overrides) into :class:`SimOptions` with a readable error."""
    if isinstance(values, SimOptions):
        if not overrides:
            return values
        values = values.model_dump()
    merged = {**(values or {}), **overrides}
    unknown = sorted(k for k in merged if k not in SimOptions.model_fields and k != "served_model_name")
    if unknown:
        raise ValueError(f"unknown simulator option(s) {', '.join(unknown)}; valid options: {', '.join(OPTION_NAMES)}")
    try:
        return SimOptions.model_validate(merged)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'options'}: {err['msg']}" for err in exc.errors()
        )
        raise ValueError(f"invalid simulator options: {problems}") from None
