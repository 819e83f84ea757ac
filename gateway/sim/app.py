"""The replica's ASGI app: routing, lifespan, error rendering and the small endpoints.

A bare ASGI callable (no framework) because one simulator process must outrun the gateway
under test; see :mod:`gateway.sim.asgi`.  Endpoints, as vLLM serves them:

- ``POST /v1/chat/completions``, ``POST /v1/completions`` (:mod:`gateway.sim.generate`)
- ``POST /v1/embeddings`` (:mod:`gateway.sim.embeddings`)
- ``GET /v1/models``, ``GET /health``, ``GET /ping``, ``GET /version``, ``GET /metrics``
- ``POST /tokenize``, ``POST /detokenize``
- ``GET /kv_event_sources`` (the KV event publisher per data-parallel rank, ``{}`` without
  one) and ``POST /reset_prefix_cache`` (``{"success": bool}``; vLLM serves it only with
  ``VLLM_SERVER_DEV_MODE=1``, the simulator always)
- with ``--enable-admin`` only: ``GET|POST /sim/faults``, ``POST /sim/restart``, ``GET /sim/state``,
  ``GET /sim/kv_blocks`` (the cached block keys and their copies)
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.sim import SIM_VERSION
from gateway.sim.asgi import TEXT, BodyTooLarge, ClientGone, Receive, Scope, Send, read_body, send_bytes
from gateway.sim.embeddings import embeddings
from gateway.sim.generate import chat_completions, completions
from gateway.sim.kvpublisher import ZmqKVPublisher
from gateway.sim.options import SimOptions, build_options
from gateway.sim.protocol import (
    APIError,
    DetokenizeRequest,
    TokenizeRequest,
    check_messages,
    check_token_ids,
    parse,
)
from gateway.sim.replica import Replica
from gateway.sim.statslog import StatsLogger
from gateway.tasks import cancel_and_wait

logger = logging.getLogger("gateway.sim.app")

Handler = Callable[[Replica, bytes, Receive, Send], Awaitable[tuple[int, bytes] | None]]

_NOT_FOUND = json.dumps({"detail": "Not Found"}).encode()
_NOT_ALLOWED = json.dumps({"detail": "Method Not Allowed"}).encode()
PROMETHEUS_CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"


def _json(payload: Any, status: int = 200) -> tuple[int, bytes]:
    return status, json.dumps(payload, separators=(",", ":")).encode()


# -- small endpoints ----------------------------------------------------------------------------


async def health(replica: Replica, body: bytes, receive: Receive, send: Send) -> tuple[int, bytes] | None:
    if replica.faults.down:
        raise APIError(503, "the server is restarting")
    await send_bytes(send, 200, b"", TEXT)  # vLLM answers an empty 200
    return None


async def version(replica: Replica, body: bytes, receive: Receive, send: Send) -> tuple[int, bytes]:
    return _json({"version": SIM_VERSION})


async def models(replica: Replica, body: bytes, receive: Receive, send: Send) -> tuple[int, bytes]:
    opts = replica.options

    def card(name: str, parent: str | None, max_len: int | None) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": replica.created,
            "owned_by": "vllm",
            "root": name,
            "parent": parent,
            "max_model_len": max_len,
            "permission": [  # vLLM's one default permission object
                {
                    "id": f"modelperm-{replica.new_id()[-16:]}",
                    "object": "model_permission",
                    "created": replica.created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }

    data = [card(opts.model, None, replica.max_model_len)]
    data += [card(name, opts.model, None) for name in opts.lora_modules]
    return _json({"object": "list", "data": data})


async def metrics(replica: Replica, body: bytes, receive: Receive, send: Send) -> tuple[int, bytes] | None:
    engine = replica.engine
    replica.metrics.set_state(engine.num_running, engine.num_waiting, engine.cache.usage)
    await send_bytes(send, 200, replica.metrics.exposition(), PROMETHEUS_CONTENT_TYPE)
    return None


async def tokenize(replica: Replica, body: bytes, receive: Receive, send: Send) -> tuple[int, bytes]:
    req: TokenizeRequest = parse(TokenizeRequest, body)
    replica.resolve_model(req.model)
    if req.messages is not None:
        check_messages(req.messages)
        tokens = replica.prompts.chat(req.messages, req.tools, req.add_generation_prompt)
    elif req.prompt is not None:
        tokens = replica.prompts.completion(req.prompt)
    else:
        raise APIError(400, "either 'prompt' or 'messages' is required", param="prompt")
    return _json({"count": len(tokens), "max_model_len": replica.max_model_len, "tokens": tokens, "token_strs": None})


async def detokenize(replica: Replica, body: bytes, receive: Receive, send: Send) -> tuple[int, bytes]:
    req: DetokenizeRequest = parse(DetokenizeRequest, body)
    replica.resolve_model(req.model)
    check_token_ids(req.tokens, "tokens")
    try:
        text = replica.tokenizer.decode(req.tokens)
    except Exception:  # an id outside the vocabulary
        raise APIError(400, "token ids out of vocabulary", param="tokens") from None
    return _json({"prompt": text})


async def kv_event_sources(replica: Replica, body: bytes, receive: Receive, send: Send) -> tuple[int, bytes]:
    publisher = replica.kv_publisher
    return _json({"0": publisher.source()} if publisher is not None else {})


async def reset_prefix_cache(
    replica: Replica, body: bytes, receive: Receive, send: Send, query: bytes = b""
) -> tuple[int, bytes]:
    params = urllib.parse.parse_qs(query.decode("latin-1"))
    running = params.get("reset_running_requests", ["false"])[-1].lower() in ("true", "1")
    logger.info("Resetting prefix cache...")
    success = replica.engine.reset_prefix_cache(reset_running_requests=running)
    return _json({"success": success})


# -- admin (fault injection) -----------------------------------------------------------------


class RestartRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    downtime_ms: float = Field(0.0, ge=0.0)
    reset_metrics: bool = False  # a real restart starts its counters from zero


async def get_faults(replica: Replica, body: bytes, receive: Receive, send: Send) -> tuple[int, bytes]:
    return _json(replica.faults.settings.model_dump())


async def set_faults(replica: Replica, body: bytes, receive: Receive, send: Send) -> tuple[int, bytes]:
    try:
        patch = json.loads(body or b"{}")
    except ValueError as exc:
        raise APIError(400, f"invalid JSON body: {exc}") from None
    if not isinstance(patch, dict):
        raise APIError(400, "expected a JSON object of fault settings")
    try:
        settings = replica.faults.update(patch)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors())
        raise APIError(400, problems or "invalid fault settings") from None
    logger.warning("fault injection settings now %s", settings.model_dump())
    return _json(settings.model_dump())


async def restart(replica: Replica, body: bytes, receive: Receive, send: Send) -> tuple[int, bytes]:
    req = parse(RestartRequest, body) if body.strip() else RestartRequest()
    aborted = replica.engine.restart()
    if req.reset_metrics:
        replica.reset_metrics()
    if req.downtime_ms:
        replica.faults.go_down(req.downtime_ms / 1000.0)
    logger.warning("simulated restart: prefix cache flushed, %d in-flight request(s) failed", aborted)
    return _json(
        {
            "restarted": True,
            "aborted_requests": aborted,
            "downtime_ms": req.downtime_ms,
            "reset_metrics": req.reset_metrics,
        }
    )


async def state(replica: Replica, body: bytes, receive: Receive, send: Send) -> tuple[int, bytes]:
    engine = replica.engine
    cache = engine.cache
    return _json(
        {
            "running": engine.num_running,
            "waiting": engine.num_waiting,
            "kv_cache_usage": cache.usage,
            "num_gpu_blocks": replica.options.num_gpu_blocks,
            "num_usable_blocks": cache.num_blocks,  # one is vLLM's null block
            "num_free_blocks": cache.num_free,
            "num_cached_blocks": cache.num_cached,
            "prefix_cache_queries": engine.total_queries,
            "prefix_cache_hits": engine.total_hits,
            "faults": replica.faults.settings.model_dump(),
        }
    )


async def kv_blocks(replica: Replica, body: bytes, receive: Receive, send: Send) -> tuple[int, bytes]:
    """The cache's content (key -> copies), to check the KV events against it in tests."""
    copies = replica.engine.cache.copies()
    return _json({"block_size": replica.block_size, "blocks": {str(k): v for k, v in copies.items()}})


# -- the app ----------------------------------------------------------------------------------


async def _inference_faults(replica: Replica) -> None:
    faults = replica.faults
    if faults.down:
        raise APIError(503, "the server is restarting")
    settings = faults.settings
    if settings.extra_latency_ms:
        await asyncio.sleep(settings.extra_latency_ms / 1000.0)
    if settings.error_rate and faults.should_fail():
        raise APIError(settings.error_status, "simulated failure (fault injection)")


class SimApp:
    """ASGI app of one replica.  Several can live in one process (tests): no global state."""

    def __init__(self, options: SimOptions) -> None:
        self.options = options
        self.replica = Replica(options)
        config = options.kv_events_config
        if config is not None and config.publishes:
            self.replica.kv_publisher = ZmqKVPublisher(config)
            self.replica.engine.kv_events.attach(self.replica.kv_publisher)
        self.stats_logger: StatsLogger | None = None
        if options.log_stats_interval > 0 and not options.disable_log_stats:
            self.stats_logger = StatsLogger(self.replica.engine, options.log_stats_interval)
        self._background: asyncio.Task[None] | None = None
        inference = {"/v1/chat/completions": chat_completions, "/v1/completions": completions}
        self.inference = {path: handler for path, handler in inference.items()}
        self.inference["/v1/embeddings"] = embeddings
        routes: dict[str, dict[str, Handler]] = {
            "/health": {"GET": health},
            "/ping": {"GET": health, "POST": health},
            "/version": {"GET": version},
            "/v1/models": {"GET": models},
            "/metrics": {"GET": metrics},
            "/tokenize": {"POST": tokenize},
            "/detokenize": {"POST": detokenize},
            "/kv_event_sources": {"GET": kv_event_sources},
            "/reset_prefix_cache": {"POST": reset_prefix_cache},
        }
        for path, handler in self.inference.items():
            routes[path] = {"POST": handler}
        if options.enable_admin:
            routes["/sim/faults"] = {"GET": get_faults, "POST": set_faults}
            routes["/sim/restart"] = {"POST": restart}
            routes["/sim/state"] = {"GET": state}
            routes["/sim/kv_blocks"] = {"GET": kv_blocks}
        self.routes = routes

    async def startup(self) -> None:
        if self._background is None and self.stats_logger is not None:
            self._background = asyncio.get_running_loop().create_task(self.stats_logger.run(), name="sim-stats")

    async def shutdown(self) -> None:
        await cancel_and_wait(self._background)
        self._background = None
        await self.replica.engine.close()
        self.close()

    def close(self) -> None:
        """Release the KV event sockets (idempotent; also for apps never served)."""
        publisher, self.replica.kv_publisher = self.replica.kv_publisher, None
        if publisher is not None:
            self.replica.engine.kv_events.attach(None)
            publisher.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.startup()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        methods = self.routes.get(path)
        if methods is None:
            await send_bytes(send, 404, _NOT_FOUND)
            return
        handler = methods.get(scope["method"])
        if handler is None:
            await send_bytes(send, 405, _NOT_ALLOWED)
            return
        if self._background is None and self.stats_logger is not None:
            await self.startup()  # servers that skip the lifespan protocol
        replica = self.replica
        try:
            body = await read_body(receive) if scope["method"] == "POST" else b""
            if path in self.inference:
                await _inference_faults(replica)
            if handler is reset_prefix_cache:  # the one endpoint with query parameters
                result = await reset_prefix_cache(replica, body, receive, send, scope.get("query_string", b""))
            else:
                result = await handler(replica, body, receive, send)
        except APIError as exc:
            await send_bytes(send, exc.status, exc.body())
            return
        except ClientGone:
            return
        except BodyTooLarge:
            await send_bytes(send, 413, APIError(413, "request body too large").body())
            return
        except Exception:
            logger.exception("unexpected error serving %s %s", scope["method"], path)
            await send_bytes(send, 500, APIError(500, "internal simulator error").body())
            return
        if result is not None:
            await send_bytes(send, result[0], result[1])


def create_app(options: SimOptions | Mapping[str, Any] | None = None, **overrides: Any) -> SimApp:
    """Build one replica's ASGI app from options (a mapping of CLI-style names, or SimOptions)."""
    return SimApp(build_options(options, **overrides))
