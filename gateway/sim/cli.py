"""``prefix-gateway sim``: start N simulated vLLM replicas on ports P..P+N-1.

    prefix-gateway sim --replicas 4 --port 8100            # or: python -m gateway.sim ...
    prefix-gateway sim --replicas 2 --time-scale 0 --num-gpu-blocks 512 \\
        --per-replica '[{}, {"num_gpu_blocks": 64}]'

Prints one line per replica once it answers ``GET /health``; Ctrl-C or SIGTERM stops them
all.  Flag names follow vLLM's where vLLM has one.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from gateway.sim import DEFAULT_MODEL
from gateway.sim.kvevents import for_replica, parse_kv_events_config
from gateway.sim.launcher import ReplicaGroup, ReplicaStartError
from gateway.sim.options import SimOptions


def _default(name: str) -> Any:
    return SimOptions.model_fields[name].default


def _int_hashes_default() -> bool:
    """vLLM reads ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` ("1" by default); so does the CLI."""
    value = os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES")
    return _default("kv_events_int_hashes") if value is None else bool(int(value))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="prefix-gateway sim",
        description="Simulated vLLM replicas: OpenAI API, prefix cache, continuous batching, metrics, faults.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--replicas", type=int, default=1, help="number of replica processes")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="port of replica 0; replica i listens on PORT+i")
    p.add_argument(
        "--per-replica",
        default=None,
        metavar="JSON|@FILE",
        help="per-replica option overrides: a JSON list of objects, e.g. '[{}, {\"num_gpu_blocks\": 64}]'",
    )
    p.add_argument("--log-dir", default=None, help="write replica-I.log files here instead of to the terminal")

    g = p.add_argument_group("model and tokenizer")
    g.add_argument("--model", "--served-model-name", dest="model", default=DEFAULT_MODEL)
    g.add_argument(
        "--tokenizer",
        default=_default("tokenizer"),
        help="llama3 (default: Llama 3.1 chat template), qwen3 (Qwen3 template), "
        "cl100k_base or o200k_base (ChatML-like), or a tokenizer.json path",
    )
    g.add_argument("--lora-modules", nargs="*", default=[], help="extra served LoRA names (NAME or NAME=PATH)")

    g = p.add_argument_group("KV cache and scheduler")
    g.add_argument("--block-size", type=int, default=_default("block_size"))
    g.add_argument(
        "--num-gpu-blocks", "--num-gpu-blocks-override", dest="num_gpu_blocks", type=int,
        default=_default("num_gpu_blocks"), help="KV cache capacity in blocks",
    )  # fmt: skip
    g.add_argument("--max-num-seqs", type=int, default=_default("max_num_seqs"))
    g.add_argument("--max-num-batched-tokens", type=int, default=_default("max_num_batched_tokens"))
    g.add_argument("--max-model-len", type=int, default=_default("max_model_len"))

    g = p.add_argument_group("timing")
    g.add_argument("--prefill-tokens-per-s", type=float, default=_default("prefill_tokens_per_s"))
    g.add_argument("--decode-ms-per-token", type=float, default=_default("decode_ms_per_token"))
    g.add_argument("--time-scale", type=float, default=_default("time_scale"), help="0 = instant")
    g.add_argument("--max-output-tokens", type=int, default=_default("max_output_tokens"))

    g = p.add_argument_group("API")
    g.add_argument("--seed", type=int, default=_default("seed"))
    g.add_argument(
        "--enable-prompt-tokens-details", action=argparse.BooleanOptionalAction,
        default=_default("enable_prompt_tokens_details"), help="report usage.prompt_tokens_details.cached_tokens",
    )  # fmt: skip
    g.add_argument(
        "--enable-auto-tool-choice", action=argparse.BooleanOptionalAction,
        default=_default("enable_auto_tool_choice"), help="serve tool calls (off: vLLM's 400 without a parser)",
    )  # fmt: skip
    g.add_argument(
        "--retokenize-drift", type=float, default=_default("retokenize_drift"),
        help="per output token, the chance the reply's ids are not what its text re-encodes to (0: exact)",
    )  # fmt: skip
    g.add_argument("--embedding-dim", type=int, default=_default("embedding_dim"))
    g.add_argument(
        "--metrics-naming", choices=("current", "legacy", "both"), default=_default("metrics_naming"),
        help="names of the metrics vLLM renamed in v0.9 (legacy: gpu_cache_usage_perc, gpu_prefix_cache_*)",
    )  # fmt: skip

    g = p.add_argument_group("KV cache events (vLLM's)")
    g.add_argument(
        "--kv-events-config", default=None, metavar="JSON",
        help='vLLM\'s JSON, e.g. \'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}\'; with several replicas, ports +i per replica',
    )  # fmt: skip
    g.add_argument(
        "--kv-events-int-hashes", action=argparse.BooleanOptionalAction, default=_int_hashes_default(),
        help="hashes as unsigned 64-bit ints or raw digests (default: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, else 1)",
    )  # fmt: skip
    g.add_argument(
        "--kv-events-layout", choices=("map", "array"), default=_default("kv_events_layout"),
        help="map: vLLM 0.32's tagged maps; array: the positional arrays of older vLLM",
    )  # fmt: skip
    g.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=_default("device"),
        help="cpu: 'CPU KV cache usage' in the log line",
    )

    g = p.add_argument_group("logs and admin")
    g.add_argument("--log-stats-interval", type=float, default=_default("log_stats_interval"))
    g.add_argument("--disable-log-stats", action="store_true")
    g.add_argument("--disable-uvicorn-access-log", action="store_true")
    g.add_argument("--enable-admin", action="store_true", help="enable /sim/faults, /sim/restart, /sim/state")

    g = p.add_argument_group("fault injection")
    g.add_argument("--error-rate", type=float, default=0.0, help="fraction of inference requests that fail")
    g.add_argument("--error-status", type=int, default=503)
    g.add_argument("--extra-latency-ms", type=float, default=0.0)
    g.add_argument("--stall-after-chunks", type=int, default=None)
    g.add_argument("--drop-after-chunks", type=int, default=None)
    return p


_NOT_OPTIONS = {"replicas", "host", "port", "per_replica", "log_dir"}


def _per_replica(value: str | None) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    text = Path(value[1:]).read_text() if value.startswith("@") else value
    data = json.loads(text)
    if not isinstance(data, list) or not all(isinstance(x, dict) for x in data):
        raise ValueError("--per-replica must be a JSON list of objects")
    return data


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    options = {k: v for k, v in vars(args).items() if k not in _NOT_OPTIONS}
    try:
        per_replica = _per_replica(args.per_replica)
        if args.kv_events_config:  # one publisher port per replica: +i, as vLLM does per DP rank
            config = parse_kv_events_config(options.pop("kv_events_config"))
            given = list(per_replica or []) + [{}] * args.replicas
            per_replica = [{"kv_events_config": for_replica(config, i), **given[i]} for i in range(args.replicas)]
        group = ReplicaGroup(
            args.replicas,
            host=args.host,
            ports=[args.port + i for i in range(args.replicas)],
            per_replica=per_replica,
            log_dir=args.log_dir,
            **options,
        )
    except (ValueError, OSError) as exc:
        print(f"prefix-gateway sim: {exc}", file=sys.stderr)
        return 2

    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():  # signals can only be handled there
        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            group.start()
        except ReplicaStartError as exc:
            print(f"prefix-gateway sim: {exc}", file=sys.stderr)
            return 1
        for replica in group.replicas:
            opts = replica.options
            print(
                f"replica {replica.index}: {replica.url}  (model {opts.model}, "
                f"{opts.num_gpu_blocks} KV blocks of {opts.block_size}, time scale {opts.time_scale:g})",
                flush=True,
            )
        print(f"{len(group.replicas)} replica(s) ready; Ctrl-C to stop", flush=True)
        while not stop.wait(0.5):
            dead = group.dead()
            if dead:
                print(f"prefix-gateway sim: replica(s) {dead} exited; stopping", file=sys.stderr)
                return 1
        return 0
    finally:
        group.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
