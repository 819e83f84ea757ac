"""``prefix-gateway``: a thin CLI that builds a config and calls the same functions a program would.

    prefix-gateway serve [--config FILE] [--replica URL ... --policy NAME] [--host H] [--port P]
    prefix-gateway check-config FILE [FILE ...]
    prefix-gateway demo [--port P]
    prefix-gateway hash-key [KEY]          (sha256 for admin.api_key_sha256 / auth.api_keys_sha256)
    prefix-gateway sim ...                 (simulated vLLM replicas; see `prefix-gateway sim --help`)

Each subcommand is one ``add_*`` function (its arguments) and one ``run_*`` function.
"""

from __future__ import annotations

import argparse
import getpass
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gateway.config import (
    ConfigError,
    GatewayConfig,
    default_config_path,
    load_config,
    parse_config,
    quick_config,
    sha256_hex,
)

Handler = Callable[[argparse.Namespace], int]


# -- serve ---------------------------------------------------------------------------------
def add_serve(sub: Any) -> None:
    p = sub.add_parser("serve", help="run the gateway", description="Run the gateway in the foreground.")
    p.add_argument("--config", "-c", help="YAML config (default: ./config/gateway.yaml, else the packaged demo)")
    p.add_argument("--replica", action="append", default=[], metavar="URL", help="quick start without a file (repeat)")
    p.add_argument("--policy", default="least_loaded", help="policy for --replica quick start")
    p.add_argument("--host", help="override server.host")
    p.add_argument("--port", type=int, help="override server.port")
    p.set_defaults(run=run_serve)


def _with_overrides(config: GatewayConfig, host: str | None, port: int | None, source: str) -> GatewayConfig:
    if host is None and port is None:
        return config
    data = config.model_dump(exclude_unset=True)
    server = dict(data.get("server", {}))
    if host is not None:
        server["host"] = host
    if port is not None:
        server["port"] = port
    data["server"] = server
    return parse_config(data, source)


def build_serve_config(args: argparse.Namespace) -> GatewayConfig:
    if args.replica:
        if args.config:
            raise SystemExit("prefix-gateway serve: use either --config or --replica, not both")
        return quick_config(
            args.replica,
            policy=args.policy,
            host=args.host or "127.0.0.1",
            port=8080 if args.port is None else args.port,
        )
    path = Path(args.config) if args.config else default_config_path()
    return _with_overrides(load_config(path), args.host, args.port, str(path))


def _exit_cleanly_on_signals() -> None:
    """uvicorn shuts down gracefully on SIGINT/SIGTERM and then re-raises the signal with the
    previous handler; make that handler a clean exit (status 0, context managers unwind — the
    demo's replicas are stopped) instead of the default kill."""

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


def run_serve(args: argparse.Namespace) -> int:
    from gateway.server import serve

    config = build_serve_config(args)
    _exit_cleanly_on_signals()
    serve(config)
    return 0


# -- check-config --------------------------------------------------------------------------
def add_check_config(sub: Any) -> None:
    p = sub.add_parser("check-config", help="validate config files", description="Validate config files.")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.set_defaults(run=run_check_config)


def run_check_config(args: argparse.Namespace) -> int:
    status = 0
    for file in args.files:
        try:
            config = load_config(file)
        except ConfigError as exc:
            print(exc, file=sys.stderr)
            status = 1
            continue
        routes = ", ".join(f"{r.name} ({r.policy})" for r in config.routes)
        print(f"{file}: OK — {len(config.replicas)} replicas, routes: {routes}")
    return status


# -- demo ----------------------------------------------------------------------------------
def add_demo(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="4 simulated replicas + the gateway on loopback",
        description="Start simulated vLLM replicas (one per replica in the config) and the gateway on 127.0.0.1. "
        "The replicas' URLs in the config are replaced by the simulated replicas' addresses, in order.",
    )
    p.add_argument("--port", type=int, default=8080, help="gateway port (0: any free port)")
    p.add_argument("--config", "-c", help="config to demo (default: config/gateway.yaml or the packaged copy)")
    p.add_argument("--time-scale", type=float, default=1.0, help="simulated time per real second (0: instant)")
    p.set_defaults(run=run_demo)


def demo_config(base: GatewayConfig, urls: Sequence[str], port: int, source: str) -> GatewayConfig:
    """The demo's config: ``base`` with replica URLs replaced by the simulated ones, on loopback."""
    data = base.model_dump(exclude_unset=True)
    data["replicas"] = [{**r, "url": url} for r, url in zip(data["replicas"], urls, strict=True)]
    data["server"] = {**data.get("server", {}), "host": "127.0.0.1", "port": port}
    return parse_config(data, source)


def _demo_model(config: GatewayConfig) -> str:
    from gateway.sim import DEFAULT_MODEL

    for route in config.routes:
        for pattern in route.match.models:
            if not any(ch in pattern for ch in "*?["):
                return pattern
    return DEFAULT_MODEL


def demo_banner(url: str, model: str, replicas: int, log_dir: str) -> str:
    base = f"{url}/v1"
    return f"""
prefix-gateway demo: {replicas} simulated vLLM replicas behind {base}
(replica logs: {log_dir})

Python (openai SDK):

    from openai import OpenAI
    client = OpenAI(base_url="{base}", api_key="unused")
    reply = client.chat.completions.create(
        model="{model}", messages=[{{"role": "user", "content": "Hello!"}}]
    )
    print(reply.choices[0].message.content, reply.usage)

curl:

    curl -s {base}/chat/completions -H 'Content-Type: application/json' \\
      -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

Metrics: {url}/metrics    Readiness: {url}/ready    Ctrl-C stops everything.
"""


def run_demo(args: argparse.Namespace) -> int:
    from gateway.server import serve
    from gateway.sim.launcher import run_replicas

    path = Path(args.config) if args.config else default_config_path()
    base = load_config(path)
    model = _demo_model(base)
    log_dir = tempfile.mkdtemp(prefix="prefix-gateway-demo-")
    print(f"starting {len(base.replicas)} simulated replicas ...", flush=True)
    with run_replicas(len(base.replicas), time_scale=args.time_scale, model=model, log_dir=log_dir) as urls:
        config = demo_config(base, urls, args.port, str(path))
        announce: Callable[[str], None] = lambda url: print(  # noqa: E731
            demo_banner(url, model, len(urls), log_dir), flush=True
        )
        _exit_cleanly_on_signals()
        serve(config, announce=announce)
    return 0


# -- hash-key ------------------------------------------------------------------------------
def add_hash_key(sub: Any) -> None:
    p = sub.add_parser(
        "hash-key",
        help="print the sha256 of an API key for the config",
        description="Print sha256(KEY) for admin.api_key_sha256 or auth.api_keys_sha256 (prompts if KEY is omitted).",
    )
    p.add_argument("key", nargs="?")
    p.set_defaults(run=run_hash_key)


def run_hash_key(args: argparse.Namespace) -> int:
    key = args.key if args.key is not None else getpass.getpass("key: ")
    print(sha256_hex(key))
    return 0


# -- main ----------------------------------------------------------------------------------
SUBCOMMANDS: list[Callable[[Any], None]] = [add_serve, add_check_config, add_demo, add_hash_key]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefix-gateway", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    sub.add_parser("sim", help="simulated vLLM replicas (see `prefix-gateway sim --help`)", add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "sim":
        from gateway.sim.cli import main as sim_main

        return sim_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
