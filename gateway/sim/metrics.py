"""Prometheus metrics with vLLM's current (v1 engine) names, labels and buckets.

Each replica owns a private :class:`~prometheus_client.CollectorRegistry`, because tests
run several replicas in one process.  Label values are bound once (``model_name`` is the
served model, ``engine="0"``) so the hot path only calls ``inc``/``observe``.  Gauges are
set from the engine's state when ``/metrics`` is scraped, as often as anyone looks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from gateway.sim.options import SimOptions

ENGINE = "0"
FINISH_REASONS = ("stop", "length", "abort")

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_value``."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class _Fanout:
    """One update to several bound metrics (the same value under current and legacy names)."""

    def __init__(self, *children: Any) -> None:
        self.children = children

    def inc(self, amount: float = 1) -> None:
        for child in self.children:
            child.inc(amount)

    def set(self, value: float) -> None:
        for child in self.children:
            child.set(value)

    def observe(self, value: float) -> None:
        for child in self.children:
            child.observe(value)


class SimMetrics:
    """All metrics of one replica, pre-bound to its labels.

    ``metrics_naming`` chooses the names of the four metrics vLLM renamed in v0.9:
    ``current`` (what vLLM exposes now), ``legacy`` (an older vLLM: ``gpu_cache_usage_perc``,
    ``gpu_prefix_cache_*``, ``time_per_output_token_seconds``) or ``both`` (vLLM 0.9/0.10
    with the deprecated ones still shown), so a consumer's fallback can be tested.
    """

    def __init__(self, options: SimOptions) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=False)
        labels = ("model_name", "engine")
        values = (options.model, ENGINE)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=registry).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=registry).labels(*values)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] | list[int]) -> Histogram:
            return Histogram(name, doc, labels, registry=registry, buckets=buckets).labels(*values)

        naming = options.metrics_naming

        def renamed(current: Callable[[], Any], legacy: Callable[[], Any]) -> Any:
            if naming == "current":
                return current()
            if naming == "legacy":
                return legacy()
            return _Fanout(current(), legacy())

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = renamed(
            lambda: gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
            lambda: gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage."),
        )
        self.prefix_queries = renamed(
            lambda: counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
            lambda: counter(
                "vllm:gpu_prefix_cache_queries", "GPU prefix cache queries, in terms of number of queried tokens."
            ),
        )
        self.prefix_hits = renamed(
            lambda: counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
            lambda: counter(
                "vllm:gpu_prefix_cache_hits", "GPU prefix cache hits, in terms of number of cached tokens."
            ),
        )
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")

        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            (*labels, "finished_reason"),
            registry=registry,
        )
        self.success = {reason: success.labels(*values, reason) for reason in FINISH_REASONS}

        token_buckets = build_1_2_5_buckets(options.effective_max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = renamed(
            lambda: histogram(
                "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
            ),
            lambda: histogram(
                "vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.", ITL_BUCKETS
            ),
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )

        # vLLM's info gauge: the cache config as labels, value 1 (no model_name label).
        info = {
            "block_size": str(options.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": "True",
            "gpu_memory_utilization": "0.9",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(options.num_gpu_blocks),
            "num_gpu_blocks_override": str(options.num_gpu_blocks),
            "prefix_caching_hash_algo": "xxh3_64",
            "sliding_window": "None",
            "engine": ENGINE,
        }
        Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            tuple(info),
            registry=registry,
        ).labels(**info).set(1)

    def set_state(self, running: int, waiting: int, kv_usage: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
