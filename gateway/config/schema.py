"""The whole configuration schema: the pydantic models behind ``gateway.yaml``.

Only the models live here (types, defaults, descriptions, local validators); validating a
file or mapping against them and the cross-checks between routes, replicas and policies
are :mod:`gateway.config.loading`, and ``docs/config.md``'s generated table is
:mod:`gateway.config.reference`.  Sub-configs are passed into constructors; nothing reads a
global.

Every field has a default and a description: ``docs/config.md`` is the reference.
"""

from __future__ import annotations

import fnmatch
import hashlib
import ipaddress
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, Field, field_validator, model_validator

from gateway.config.errors import ConfigError
from gateway.discovery.settings import DiscoveryConfig
from gateway.flow.settings import FlowControlSettings, RouteFlowSettings
from gateway.kv_events.settings import KvEventsSettings
from gateway.prefix.settings import NormalizeSettings, PrefixSettings

ENDPOINTS = ("chat", "completions", "embeddings")
DEFAULT_ADMIN_KEY_ENV = "PREFIX_GATEWAY_ADMIN_KEY"
DEFAULT_API_KEYS_ENV = "PREFIX_GATEWAY_API_KEYS"


class _Strict(BaseModel):
    model_config = {"extra": "forbid"}


def _is_sha256_hex(value: str) -> bool:
    return len(value) == 64 and all(c in "0123456789abcdef" for c in value.lower())


def sha256_hex(secret: str) -> str:
    """How API keys are stored in config: ``prefix-gateway hash-key`` prints this."""
    return hashlib.sha256(secret.encode()).hexdigest()


class ServerSettings(_Strict):
    """The listening socket and per-request limits."""

    host: str = Field("127.0.0.1", description="address to bind; 0.0.0.0 in containers")
    port: int = Field(8080, ge=0, le=65535, description="TCP port (0 picks a free one)")
    max_body_bytes: int = Field(
        10 * 1024 * 1024, ge=1024, description="request bodies larger than this get 413 (default 10 MiB)"
    )
    max_concurrency: int = Field(
        2048,
        ge=1,
        description="proxied requests (/v1/*) in flight in this process, streams included; beyond it 503 "
        "server_overloaded with retry-after (probes, metrics and admin are not counted); live on reload",
    )
    max_buffered_body_bytes: int = Field(
        64 * 1024 * 1024,
        ge=1024,
        description="request-body bytes all in-flight proxied requests of this process may hold together "
        "(a declared Content-Length is reserved before the body is read, a chunked body as it arrives); "
        "beyond it 503 server_overloaded with retry-after; at least max_body_bytes; live on reload "
        "(default 64 MiB: 2-9x that in memory by body shape, see docs/sizing.md)",
    )
    response_headers: bool = Field(
        True, description="add x-prefix-gateway-replica / x-prefix-gateway-route to responses"
    )
    request_id_header: str = Field(
        "x-request-id", description="accepted from clients, generated if absent, sent upstream"
    )
    timeout_graceful_shutdown_s: float = Field(10.0, ge=0, description="how long in-flight requests get on shutdown")
    header_timeout_s: float = Field(
        10.0, gt=0, description="a request head (line and headers) must arrive within this; else 408 and close"
    )
    body_timeout_s: float = Field(
        60.0, gt=0, description="a request body must arrive within this after its head; else the connection closes"
    )
    max_header_bytes: int = Field(
        32 * 1024, ge=1024, description="request line plus headers larger than this get 431 and a close"
    )
    max_headers: int = Field(100, ge=8, description="requests with more header fields than this get 431 and a close")
    expose_openapi: bool = Field(
        False,
        description="serve /openapi.json, /docs and /redoc (off: they answer 404; the API is OpenAI's, "
        "the schema only helps someone mapping the gateway)",
    )
    drain_grace_s: float = Field(
        2.0,
        ge=0,
        description="on SIGTERM /ready turns 503 at once; new connections are still accepted this long "
        "(load balancers catch up), then refused while running requests finish",
    )

    @model_validator(mode="after")
    def _body_cap_holds_one_body(self) -> ServerSettings:
        if self.max_buffered_body_bytes < self.max_body_bytes:
            raise ValueError(
                f"max_buffered_body_bytes ({self.max_buffered_body_bytes}) must be at least max_body_bytes "
                f"({self.max_body_bytes}): else a body the size limit allows could never be read"
            )
        return self


class UpstreamSettings(_Strict):
    """How the gateway talks to replicas (one pooled keep-alive session per replica)."""

    connect_timeout_s: float = Field(5.0, gt=0, description="TCP connect timeout")
    read_timeout_s: float = Field(
        600.0, gt=0, description="longest silence while waiting for response bytes (also between stream chunks)"
    )
    max_connections_per_replica: int = Field(0, ge=0, description="connection pool size per replica (0 = unlimited)")
    keepalive_timeout_s: float = Field(
        4.0,
        gt=0,
        description="idle keep-alive connections are closed after this; keep it below the replicas' own "
        "keep-alive (vLLM/uvicorn: 5 s) so the gateway never reuses a connection the replica is closing",
    )
    max_retries: int = Field(
        2, ge=0, le=10, description="retries on another replica, only before any byte reached the client"
    )
    retry_on_status: list[int] = Field(
        default_factory=lambda: [503], description="upstream statuses that are retried (besides connection failures)"
    )
    stream_usage: bool = Field(
        True,
        description="ask replicas for usage in streams (stream_options.include_usage) and strip it again "
        "when the client did not ask, so token metrics cover streams too",
    )
    stream_idle_timeout_s: float = Field(
        30.0,
        gt=0,
        description="longest silence between two chunks of a stream once it has started: a stalled "
        "stream then ends with an SSE error event (time to the first chunk is read_timeout_s)",
    )
    forward_client_authorization: bool = Field(
        False,
        description="pass the client's Authorization header upstream (instead of the replica's api_key) "
        "for every route; off by default so a key meant for the gateway never reaches a backend "
        "(routes can override: routes[].forward_client_authorization)",
    )
    forward_headers: list[str] = Field(
        default_factory=lambda: ["x-session-id", "x-vllm-priority"],
        description="client request headers passed upstream unchanged (case-insensitive names): vLLM reads "
        "X-Vllm-Priority (overrides the body's priority under priority scheduling) and session-aware engines "
        "and peers read X-Session-ID; the body (cache_salt, priority, session_id, a LoRA adapter as model) is "
        "always forwarded as the client sent it unless normalization rewrote the prompt",
    )

    @field_validator("forward_headers")
    @classmethod
    def _forwardable(cls, value: list[str]) -> list[str]:
        out = []
        for name in value:
            low = name.strip().lower()
            if not _HEADER_NAME.match(low):
                raise ValueError(f"{name!r} is not a header name")
            if low in _NEVER_FORWARDED:
                raise ValueError(f"{name!r} is set by the gateway itself and cannot be forwarded")
            out.append(low)
        return list(dict.fromkeys(out))


_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9a-z-]+$")
#: headers the gateway sets (or that belong to one connection): a client's copy never goes upstream
_NEVER_FORWARDED = frozenset(
    {
        "authorization",
        "connection",
        "content-length",
        "content-type",
        "host",
        "keep-alive",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "x-request-id",
    }
)


def _absolute_path(value: str) -> str:
    """An upstream path is appended to the replica's base URL: it must start with ``/``."""
    if not value.startswith("/"):
        raise ValueError(f"must start with '/' (got {value!r})")
    return value


class HealthSettings(_Strict):
    """Active (``GET /health``) and passive (errors on real traffic) health checking."""

    interval_s: float = Field(5.0, gt=0, description="active check period per replica")
    timeout_s: float = Field(2.0, gt=0, description="active check timeout")
    path: str = Field("/health", description="path probed on each replica (starts with /)")

    _path = field_validator("path")(lambda cls, value: _absolute_path(value))
    unhealthy_threshold: int = Field(2, ge=1, description="consecutive failed active checks that mark a replica down")
    healthy_threshold: int = Field(1, ge=1, description="consecutive good active checks that bring it back")
    # -- outlier detection on real traffic (Envoy-like; see docs/faults.md) --------------
    passive_5xx_threshold: int = Field(
        5,
        ge=1,
        description="consecutive failures on real traffic (5xx, connect failures, broken connections, "
        "stalled streams) that eject a replica; one failure never does",
    )
    eject_s: float = Field(
        5.0, ge=0, description="base ejection time: the n-th ejection in a row lasts eject_s * 2^(n-1), capped"
    )
    max_eject_s: float = Field(60.0, ge=0, description="cap on one ejection's length")
    failure_rate_percent: float = Field(
        50.0, ge=0, le=100, description="also eject when this share of a window's requests failed (0 = off)"
    )
    failure_rate_window_s: float = Field(10.0, gt=0, description="window of the failure-rate check")
    failure_rate_min_requests: int = Field(
        20, ge=1, description="requests a window needs before its failure rate counts"
    )
    max_ejected_percent: float = Field(
        50.0,
        ge=0,
        le=100,
        description="never eject more than this share of the fleet at once (at least one replica may be)",
    )
    panic_threshold_percent: float = Field(
        50.0,
        ge=0,
        le=100,
        description="when a route's healthy share falls below this, route over all its replicas (panic "
        "mode) instead of failing requests (0 = off)",
    )
    slow_ttft_factor: float = Field(
        3.0,
        ge=0,
        description="a replica whose smoothed time to first byte exceeds this times the fleet's median is "
        "deprioritized (never ejected); per token of the prefill queued ahead of each request where the gateway "
        "knows it (queueing is not slowness); 0 = off",
    )
    slow_min_extra_s: float = Field(
        0.5, ge=0, description="...and exceeds the median by at least this much (ignores noise at tiny latencies)"
    )
    slow_probe_every: int = Field(
        10, ge=1, description="a deprioritized replica still gets every n-th request of its routes (a latency probe)"
    )


class ScrapeSettings(_Strict):
    """Periodic scrape of each replica's vLLM ``/metrics``."""

    enabled: bool = Field(True, description="scrape engine metrics (KV usage, queue, prefix-cache counters)")
    interval_s: float = Field(5.0, gt=0, description="scrape period")
    timeout_s: float = Field(2.0, gt=0, description="scrape timeout")
    path: str = Field("/metrics", description="path scraped on each replica (starts with /)")

    _path = field_validator("path")(lambda cls, value: _absolute_path(value))


class LoggingSettings(_Strict):
    """Logs: a quiet access log and a periodic summary line per route."""

    level: Literal["debug", "info", "warning", "error"] = Field("info", description="root log level")
    format: Literal["text", "json"] = Field("text", description="text lines or one JSON object per line")
    access_log: bool = Field(True, description="one line per request")
    access_log_probes: bool = Field(False, description="also log /health, /ready and /metrics requests")
    summary_interval_s: float = Field(10.0, ge=0, description="period of the per-route summary line (0 = off)")
    log_prompts: bool = Field(False, description="DEBUG ONLY: include prompt text in debug logs")


class AdminSettings(_Strict):
    """``/admin/*`` is off unless a key is configured (hash in the file, or the plain key in an env var)."""

    api_key_sha256: str | None = Field(None, description="sha256 hex of the admin key (prefix-gateway hash-key)")
    api_key_env: str = Field(DEFAULT_ADMIN_KEY_ENV, description="env var holding the plain admin key")

    @field_validator("api_key_sha256")
    @classmethod
    def _hex(cls, value: str | None) -> str | None:
        if value is not None and not _is_sha256_hex(value):
            raise ValueError("must be 64 hex characters (sha256 of the key); use `prefix-gateway hash-key`")
        return value.lower() if value else value

    def key_hashes(self, environ: Mapping[str, str] | None = None) -> list[str]:
        env = os.environ if environ is None else environ
        hashes = [self.api_key_sha256] if self.api_key_sha256 else []
        if env.get(self.api_key_env):
            hashes.append(sha256_hex(env[self.api_key_env]))
        return hashes


class SampleSettings(_Strict):
    """A bounded buffer of recent request *shapes* for ``GET /admin/samples`` and ``prefix-gateway doctor``.

    Off by default: it costs a second tokenize-and-hash per request (the chain without the
    tenant salt, and the chain the request would have with every detected span relocated),
    which is what lets ``doctor`` estimate a fix's gain by replay without any prompt text.
    """

    enabled: bool = Field(False, description="record the shape of recent requests (roles, lengths, fingerprints)")
    max_count: int = Field(256, ge=1, le=100_000, description="keep at most this many recent samples")
    max_bytes: int = Field(
        2_000_000, ge=4096, description="and at most this many bytes of them (JSON size); the oldest go first"
    )
    include_text: bool = Field(
        False,
        description="DEBUG ONLY: also keep each request body (prompt text) so doctor can test new rules on it",
    )


class AuthSettings(_Strict):
    """Optional client API keys for ``/v1/*`` (off when none are configured)."""

    api_keys_sha256: list[str] = Field(default_factory=list, description="sha256 hex of each accepted client key")
    api_keys_env: str = Field(DEFAULT_API_KEYS_ENV, description="env var with comma-separated plain client keys")

    @field_validator("api_keys_sha256")
    @classmethod
    def _hex(cls, values: list[str]) -> list[str]:
        for value in values:
            if not _is_sha256_hex(value):
                raise ValueError("each entry must be 64 hex characters (sha256 of the key)")
        return [v.lower() for v in values]

    def key_hashes(self, environ: Mapping[str, str] | None = None) -> list[str]:
        env = os.environ if environ is None else environ
        plain = [k.strip() for k in env.get(self.api_keys_env, "").split(",") if k.strip()]
        return list(self.api_keys_sha256) + [sha256_hex(k) for k in plain]


_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
_REDIS_URL_RULE = "a Redis URL must start with redis://, rediss:// or unix://"


class StateSettings(_Strict):
    """Where routing state lives: this process only, or shared by every gateway process via Redis.

    With ``redis``, each gateway publishes the prefix-affinity records it makes (which replica
    got which prompt prefix) and applies everyone else's, so a conversation whose turns reach
    different gateway pods still finds the replica holding its history.  Publishing is
    write-behind: a request never waits on Redis, and a Redis outage only degrades affinity
    to per-process until it is back.
    """

    backend: Literal["memory", "redis"] = Field("memory", description="memory: per process; redis: shared")
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0", description="redis:// or rediss:// URL (overridden by redis_url_env when set)"
    )
    redis_url_env: str = Field(
        "PREFIX_GATEWAY_REDIS_URL", description="env var holding the Redis URL (e.g. with a password, from a Secret)"
    )
    channel: str = Field(
        "prefix-gateway:affinity",
        min_length=1,
        description="pub/sub channel; gateways sharing a fleet (same replica names) must share it",
    )
    max_pending: int = Field(
        10_000, ge=1, description="affinity records waiting to be published; the oldest are dropped beyond this"
    )
    batch_interval_ms: float = Field(5.0, ge=0.5, le=1000.0, description="how often pending records are published")
    share_load: bool = Field(
        True,
        description="also publish this process's per-replica in-flight and queued-prefill counts and add the "
        "peers' to what policies see (the load bound then covers every gateway's requests)",
    )
    load_interval_ms: float = Field(
        20.0, ge=10.0, le=10_000.0, description="how often load is published (when it changed; at least once a second)"
    )
    peer_load_ttl_s: float = Field(
        3.0, gt=0.0, le=600.0, description="a peer's load report older than this is dropped (the peer is gone)"
    )
    catch_up_keys: int = Field(
        16_384,
        ge=0,
        le=1_000_000,
        description="when a new gateway process appears (its first load report), send it this many of the most "
        "recent affinity keys so it does not start blind (needs share_load; 0 = off)",
    )
    catch_up_ready_wait_s: float = Field(
        8.0,
        ge=0.0,
        le=300.0,
        description="a gateway process that starts answers /ready with 503 until its peers' catch-up snapshot "
        "has landed, at most this long (0 = ready at once); one that hears no peer within 1.5 s is ready then",
    )

    secret_env: str = Field(
        "PREFIX_GATEWAY_STATE_SECRET",
        description="env var holding the shared secret that signs peer messages (HMAC-SHA256); when set, "
        "unsigned or badly signed messages are dropped. Every gateway sharing the channel needs the same one",
    )
    secret: str | None = Field(
        None, min_length=16, description="the shared secret in the file (prefer secret_env, from a Secret)"
    )

    def resolved_secret(self, environ: Mapping[str, str] | None = None) -> str | None:
        env = os.environ if environ is None else environ
        return env.get(self.secret_env) or self.secret

    @model_validator(mode="after")
    def _ttl_outlives_reports(self) -> StateSettings:
        every = max(1.0, self.load_interval_ms / 1000.0)  # a report goes out at least this often
        if self.peer_load_ttl_s <= 2 * every:
            raise ValueError(
                f"peer_load_ttl_s ({self.peer_load_ttl_s}) must exceed twice the report interval ({every:g} s), "
                "or peers' load would flicker out between reports"
            )
        return self

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str) -> str:
        if not value.startswith(_REDIS_SCHEMES):
            raise ValueError(_REDIS_URL_RULE)
        return value

    def resolved_redis_url(self, environ: Mapping[str, str] | None = None) -> str:
        """The URL to use; one from the environment is checked like the file's (without echoing it)."""
        env = os.environ if environ is None else environ
        value = env.get(self.redis_url_env)
        if not value:
            return self.redis_url
        if not value.startswith(_REDIS_SCHEMES):
            raise ConfigError(f"environment variable {self.redis_url_env}", [("", _REDIS_URL_RULE)])
        return value


class LimitsSettings(_Strict):
    """Admission limits: early context-length 400s and per-API-key 429s (see docs/security.md)."""

    context_check: bool = Field(
        True,
        description="answer 400 context_length_exceeded at the gateway when a prompt certainly exceeds the "
        "model's max_model_len (from the replicas' /v1/models)",
    )
    context_bytes_per_token: int = Field(
        128,
        ge=1,
        description="the most UTF-8 bytes one token of the served models' vocabularies covers (128 for "
        "cl100k/o200k): text is counted as at least bytes / this many tokens",
    )
    models_refresh_s: float = Field(
        30.0,
        gt=0,
        description="how often the replicas' /v1/models is re-read: max_model_len (context check) and which "
        "names are LoRA adapters of which base model (routing keys)",
    )
    per_key_concurrency: int = Field(0, ge=0, description="requests in flight per API key (0 = unlimited)")
    per_key_requests_per_s: float = Field(
        0.0, ge=0, description="token-bucket refill rate per API key, requests/s (0 = unlimited)"
    )
    per_key_burst: int = Field(0, ge=0, description="token-bucket capacity per key (0 = the rate, at least 1)")
    concurrency_lease_s: float = Field(
        900.0,
        gt=0,
        description="with Redis: a slot held by a gateway that died is freed after this (longer than any request)",
    )
    max_keys: int = Field(
        100_000,
        ge=1,
        le=10_000_000,
        description="token buckets kept per process, least recently used forgotten first (about 280 bytes each: "
        "100,000 is ~28 MB)",
    )
    client_identity: Literal["peer", "forwarded"] = Field(
        "peer",
        description="with auth off, whose bucket a request counts against: peer = the TCP peer's address; "
        "forwarded = the right-most untrusted hop of forwarded_header, believed only from trusted_proxies "
        "(with auth on it is always the matched API key)",
    )
    forwarded_header: str = Field(
        "x-forwarded-for",
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9-]+$",
        description="the header a trusted proxy appends the client's address to (client_identity: forwarded)",
    )
    trusted_proxies: list[str] = Field(
        default_factory=list,
        max_length=256,
        description="CIDRs (or addresses) of the proxies whose forwarded_header is believed, e.g. the ingress "
        "pods' range 10.0.0.0/8; from any other peer the header is ignored",
    )
    ipv6_prefix_len: int = Field(
        64, ge=8, le=128, description="IPv6 clients share a bucket per this prefix (one host gets a whole /64)"
    )
    redis_timeout_ms: float = Field(
        50.0,
        gt=0,
        le=5000,
        description="with Redis: each limit check's bound; a check that takes longer falls back to local "
        "limits and opens the circuit breaker",
    )
    redis_backoff_ms: float = Field(
        500.0,
        gt=0,
        le=60_000,
        description="with Redis: after a failure Redis is skipped and PINGed in the background after this "
        "long, doubling per failed PING",
    )
    redis_backoff_max_s: float = Field(
        10.0, gt=0, le=600, description="with Redis: the longest wait between background PINGs while it fails"
    )

    @field_validator("trusted_proxies")
    @classmethod
    def _cidrs(cls, values: list[str]) -> list[str]:
        out = []
        for value in values:
            try:
                out.append(str(ipaddress.ip_network(value.strip(), strict=False)))
            except ValueError:
                raise ValueError(f"{value!r} is not an IP address or CIDR (e.g. 10.0.0.0/8)") from None
        return out

    @model_validator(mode="after")
    def _forwarded_needs_trust(self) -> LimitsSettings:
        if self.client_identity == "forwarded" and not self.trusted_proxies:
            raise ValueError("client_identity: forwarded needs trusted_proxies (else the header is never believed)")
        return self


class WarmRestartSettings(_Strict):
    """Replay the hottest prefixes to a replica that comes back with an empty cache (docs/fleet.md).

    Off by default: it keeps recent request bodies (prompt text) in memory, per route and
    replica, bounded by ``max_prefixes`` and ``max_bytes``; they are never logged.
    """

    enabled: bool = Field(
        False, description="remember the hottest prefixes per replica and replay them when it restarts"
    )
    max_prefixes: int = Field(
        256, ge=1, le=100_000, description="prefixes remembered per route and replica (the coldest go first)"
    )
    max_bytes: int = Field(
        8 * 1024 * 1024,
        ge=4096,
        description="request-body bytes remembered per route and replica; a body larger than this is not kept",
    )
    max_replays: int = Field(64, ge=1, le=100_000, description="replays per warm-up: the hottest this many prefixes")
    rate_per_s: float = Field(10.0, gt=0, le=10_000, description="replays started per second, at most")
    concurrency: int = Field(2, ge=1, le=256, description="replays in flight at once, at most")
    timeout_s: float = Field(30.0, gt=0, description="one replay's deadline (prefill of a long prompt)")
    half_life_s: float = Field(
        300.0, gt=0, description="hotness = requests weighted by recency: a request counts half after this long"
    )
    key_tokens: int = Field(
        256,
        ge=1,
        description="a prefix is the prompt's first key_tokens tokens (or its session header's value); its "
        "latest body is what gets replayed",
    )
    cooldown_s: float = Field(
        60.0, ge=0, description="a replica warmed up this recently is not warmed again (one restart, two signals)"
    )
    on_rejoin: bool = Field(
        True,
        description="also warm up a replica that returns to healthy after being down or ejected (besides "
        "engine counters going backwards)",
    )


class ReplicaConfig(_Strict):
    """One upstream vLLM (or simulated) server."""

    name: str = Field(..., min_length=1, max_length=64, description="unique; used in metrics and headers")
    url: str = Field(..., description="base URL, e.g. http://10.0.0.5:8000 (no /v1)")
    weight: float = Field(1.0, gt=0, description="relative capacity (policies that weigh replicas use it)")
    api_key: str | None = Field(None, description="sent upstream as Bearer token (prefer api_key_env)")
    api_key_env: str | None = Field(None, description="env var holding the upstream API key")

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        parts = urlsplit(value)
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            # the gateway appends /v1/...: a base path would make /v1/v1/... (or worse)
            raise ValueError(f"must be scheme://host:port only, without a path (got path {parts.path!r})")
        return value.rstrip("/")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not all(c.isalnum() or c in "-_." for c in value):
            raise ValueError("use letters, digits, '-', '_' or '.' only")
        return value

    def resolved_api_key(self, environ: Mapping[str, str] | None = None) -> str | None:
        env = os.environ if environ is None else environ
        if self.api_key_env and env.get(self.api_key_env):
            return env[self.api_key_env]
        return self.api_key


class HeaderMatch(_Strict):
    """Match on one request header (e.g. a tenant id)."""

    name: str = Field(..., description="header name (case-insensitive)")
    values: list[str] = Field(..., min_length=1, description="accepted values (fnmatch patterns)")


class RouteMatch(_Strict):
    """Which requests a route takes: first matching route wins, in file order."""

    models: list[str] = Field(default_factory=lambda: ["*"], description="model names (fnmatch patterns)")
    header: HeaderMatch | None = Field(None, description="optional header condition")

    def matches(self, model: str, headers: Mapping[str, str]) -> bool:
        if not any(p == model or p == "*" or fnmatch.fnmatchcase(model, p) for p in self.models):
            return False
        if self.header is not None:
            value = headers.get(self.header.name.lower())
            if value is None or not any(fnmatch.fnmatchcase(value, p) for p in self.header.values):
                return False
        return True


class RouteConfig(_Strict):
    """Binds matching requests to a pool of replicas with a policy and its settings."""

    name: str = Field(..., min_length=1, max_length=64, description="unique; a metric label")
    match: RouteMatch = Field(default_factory=RouteMatch, description="which requests this route takes")
    endpoints: list[Literal["chat", "completions", "embeddings"]] = Field(
        default_factory=lambda: list(ENDPOINTS), description="endpoints served by this route"
    )
    replicas: list[str] | None = Field(
        None,
        description="replica names in the pool, and discovery source names (every replica the source reports); "
        "default: all",
    )
    policy: str = Field(
        "prefix",
        description="routing policy name (see the registry); prefix: prefix-cache-aware, least loaded for "
        "requests without prompt keys (embeddings, very short prompts)",
    )
    policy_settings: dict[str, Any] = Field(default_factory=dict, description="validated by the policy's own model")
    session_header: str = Field("x-session-id", description="header whose value becomes the request's session key")
    forward_client_authorization: bool | None = Field(
        None,
        description="send the client's Authorization header to this route's replicas instead of their "
        "api_key (null: upstream.forward_client_authorization)",
    )
    normalize: NormalizeSettings = Field(default_factory=NormalizeSettings, description="volatile-span handling")
    prefix: PrefixSettings = Field(default_factory=PrefixSettings, description="prefix tokenization and keying")
    flow_control: RouteFlowSettings = Field(
        default_factory=RouteFlowSettings, description="this route's default priority and X-Vllm-Priority forwarding"
    )
    warm_restart: WarmRestartSettings | None = Field(
        None, description="this route's warm-restart settings (null: the top-level warm_restart)"
    )


class GatewayConfig(_Strict):
    """The root of ``gateway.yaml``."""

    server: ServerSettings = Field(default_factory=ServerSettings)
    upstream: UpstreamSettings = Field(default_factory=UpstreamSettings)
    health: HealthSettings = Field(default_factory=HealthSettings)
    scrape: ScrapeSettings = Field(default_factory=ScrapeSettings)
    logging: LoggingSettings = Field(default_factory=LoggingSettings)
    admin: AdminSettings = Field(default_factory=AdminSettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    state: StateSettings = Field(default_factory=StateSettings)
    limits: LimitsSettings = Field(default_factory=LimitsSettings)
    samples: SampleSettings = Field(default_factory=SampleSettings)
    warm_restart: WarmRestartSettings = Field(default_factory=WarmRestartSettings)
    kv_events: KvEventsSettings = Field(
        default_factory=KvEventsSettings,
        description="precise routing from the replicas' KV cache events (vLLM --kv-events-config)",
    )
    flow_control: FlowControlSettings = Field(
        default_factory=FlowControlSettings,
        description="hold requests while a route is saturated; dispatch by priority and per-tenant fairness",
    )
    replicas: list[ReplicaConfig] = Field(
        default_factory=list, description="static replicas (at least one, unless discovery sources are set)"
    )
    discovery: list[DiscoveryConfig] = Field(
        default_factory=list, description="replica sources (DNS, Kubernetes EndpointSlices), named for routes' pools"
    )
    routes: list[RouteConfig] = Field(
        default_factory=lambda: [RouteConfig(name="default")],
        description="default: one route taking every model to every replica with the prefix policy",
    )

    @model_validator(mode="after")
    def _cross_references(self) -> GatewayConfig:
        if not self.replicas and not self.discovery:
            raise ValueError("replicas: at least one replica (or a discovery source) is required")
        _unique([r.name for r in self.replicas], "replicas")
        _unique([d.name for d in self.discovery], "discovery")
        _unique([r.name for r in self.replicas] + [d.name for d in self.discovery], "replicas and discovery")
        _unique([r.name for r in self.routes], "routes")
        unknown = sorted(set(self.kv_events.endpoints) - {r.name for r in self.replicas})
        if unknown and not self.discovery:
            raise ValueError(f"kv_events.endpoints: no replica named {', '.join(map(repr, unknown))}")
        return self

    def warm_restart_of(self, route: RouteConfig) -> WarmRestartSettings:
        """``route``'s own warm-restart settings, else the top-level ones."""
        return route.warm_restart if route.warm_restart is not None else self.warm_restart

    def pool_of(self, route: RouteConfig) -> list[ReplicaConfig]:
        if route.replicas is None:
            return list(self.replicas)
        by_name = {r.name: r for r in self.replicas}
        return [by_name[n] for n in route.replicas if n in by_name]

    def sources_of(self, route: RouteConfig) -> list[str]:
        """The discovery sources whose replicas join ``route``'s pool (all of them by default)."""
        names = [d.name for d in self.discovery]
        return names if route.replicas is None else [n for n in route.replicas if n in names]


def _unique(names: Sequence[str], where: str) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"{where}: duplicate name {name!r}")
        seen.add(name)
