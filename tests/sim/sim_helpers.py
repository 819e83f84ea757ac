"""Helpers shared by the simulator tests (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import httpx
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim.tokenizer import PromptBuilder, SimTokenizer
from tests.polling import wait_for
from tests.sdk import openai_client

# The replica's default tokenizer and prompt rendering (its own code, as vLLM would: Llama 3.1
# template, specials parsed, BOS on completions): what prompt_tokens must count.
SIM_TOKENIZER = SimTokenizer("llama3")
SIM_PROMPTS = PromptBuilder(SIM_TOKENIZER, SIM_TOKENIZER.encode)

# Instant (time_scale 0), quiet: what most tests want.
FAST: dict[str, Any] = {"time_scale": 0, "log_stats_interval": 0, "disable_uvicorn_access_log": True}

T = TypeVar("T")


def client(url: str, **kwargs: Any) -> OpenAI:
    return openai_client(url + "/v1", api_key="sim", **kwargs)


def scrape(url: str) -> dict[str, float]:
    """``/metrics`` parsed with prometheus_client's own parser: {sample name{labels}: value}."""
    text = httpx.get(url + "/metrics").text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k not in ("model_name", "engine"))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def poll(check: Callable[[], T | None], timeout: float = 10.0, interval: float = 0.01) -> T:
    """The shared poller with the simulator suite's finer interval."""
    return wait_for(check, timeout, interval)
