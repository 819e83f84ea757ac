"""Parse a replica's vLLM ``/metrics`` into the few engine numbers the gateway uses.

Current (v1 engine) names first, the deprecated ``gpu_*`` names as a fallback (hidden since
vLLM 0.9, but older fleets still export them).  Series are summed over their label sets
(``model_name``, ``engine``), so a replica with several engines reads as one.  Absent
series stay ``None``: "unknown", never 0.

The scan runs on the gateway's event loop every few seconds per replica, so it must be
cheap: a full exposition parser (prometheus_client's) spends ~2.5 ms on a small vLLM page
and far more on a real one, stalling every request in flight.  We only need a handful of
series, so lines are filtered by name first and only the matches are split.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

# field -> sample names, preferred first
_SERIES: dict[str, tuple[str, ...]] = {
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    "prefix_cache_queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    "prefix_cache_hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    "preemptions": ("vllm:num_preemptions_total",),
    "prompt_tokens": ("vllm:prompt_tokens_total",),
    "generation_tokens": ("vllm:generation_tokens_total",),
}
_WANTED = {name: field for field, names in _SERIES.items() for name in names}


@dataclass(frozen=True, slots=True)
class EngineStats:
    """One scrape of one replica."""

    scraped_at: float  # time.monotonic()
    kv_cache_usage: float | None = None  # 0..1
    running: float | None = None
    waiting: float | None = None
    prefix_cache_queries: float | None = None  # tokens, counter
    prefix_cache_hits: float | None = None  # tokens, counter
    preemptions: float | None = None
    prompt_tokens: float | None = None
    generation_tokens: float | None = None
    block_size: int | None = None  # from vllm:cache_config_info
    num_gpu_blocks: int | None = None

    @property
    def kv_cache_tokens(self) -> int | None:
        """The prefix cache's size in tokens, when the engine published its cache config."""
        if self.num_gpu_blocks and self.block_size:
            return self.num_gpu_blocks * self.block_size
        return None

    @property
    def hit_rate(self) -> float | None:
        if self.prefix_cache_queries and self.prefix_cache_hits is not None:
            return self.prefix_cache_hits / self.prefix_cache_queries
        return None


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_INFO = "vllm:cache_config_info"


def _sample(line: str) -> tuple[str, str, float] | None:
    """``name{labels} value [timestamp]`` -> (name, labels text, value)."""
    brace = line.find("{")
    if brace >= 0:
        close = line.rfind("}")
        if close < brace:
            return None
        name, labels, rest = line[:brace], line[brace + 1 : close], line[close + 1 :]
    else:
        name, _, rest = line.partition(" ")
        labels = ""
    parts = rest.split()
    if not parts:
        return None
    try:
        return name, labels, float(parts[0])
    except ValueError:
        return None


def parse_engine_metrics(text: str, now: float | None = None) -> EngineStats:
    """Extract :class:`EngineStats` from Prometheus text exposition (tolerates anything missing)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    info: dict[str, str] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        end = line.find("{")
        if end < 0:
            end = line.find(" ")
        name = line[:end]
        if name not in _WANTED and name != _INFO:
            continue
        sample = _sample(line)
        if sample is None:
            continue
        if name == _INFO:
            if not info:
                info = dict(_LABEL.findall(sample[1]))
            continue
        sums[name] = sums.get(name, 0.0) + sample[2]
        counts[name] = counts.get(name, 0) + 1
    values: dict[str, float | None] = {}
    for field, names in _SERIES.items():
        found = next((n for n in names if n in sums), None)
        value = None if found is None else sums[found]
        if field == "kv_cache_usage" and found is not None and counts[found] > 1:
            value = sums[found] / counts[found]  # a fraction: average over engines
        values[field] = value
    return EngineStats(
        scraped_at=time.monotonic() if now is None else now,
        block_size=_int(info.get("block_size")),
        num_gpu_blocks=_int(info.get("num_gpu_blocks")),
        **values,
    )


def _int(value: str | None) -> int | None:
    try:
        return int(float(value)) if value not in (None, "", "None") else None
    except ValueError:
        return None
