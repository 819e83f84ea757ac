"""The ``/v1/*`` request path as a plain ASGI app: parse → plan → forward → record.

One :class:`Exchange` per request keeps the stages small and in order; it never reaches back
into an earlier stage.  Raw ASGI (not a framework endpoint) because this is the hot path:
the client's bytes are forwarded as they are unless preparation rewrote the body, responses
are relayed chunk by chunk, and a task watching for ``http.disconnect`` cancels the work (and
so drops the upstream connection, which makes vLLM abort the request) the moment the client
goes away.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from time import perf_counter
from typing import Any

from gateway.errors import (
    BadGateway,
    ClientDisconnected,
    GatewayError,
    GatewayTimeout,
    InternalError,
    NoHealthyReplica,
    RedirectRefused,
    StreamFailed,
    Unauthorized,
    error_bytes,
)
from gateway.flow.classify import vllm_priority
from gateway.http.capacity import BodyReservation, Slot
from gateway.limits.admission import Ticket
from gateway.observe.outcome import Outcome
from gateway.proxy.parse import as_utf8, parse_body, read_body
from gateway.proxy.usage import StreamRelay, Usage, sniff_json_usage
from gateway.replicas.pool import Replica
from gateway.routing.attempt import Attempt
from gateway.routing.base import Decision
from gateway.routing.plan import Draft, Plan
from gateway.service import ENDPOINT_PATHS, Gateway
from gateway.upstream.client import UpstreamResponse
from gateway.upstream.errors import UpstreamAbandoned, UpstreamError, UpstreamReadTimeout, UpstreamStalled

log = logging.getLogger("prefix_gateway.proxy")

#: keys this module reads from / writes to the ASGI scope (set by ``gateway.http.middleware``)
REQUEST_ID_KEY = "prefix_gateway.request_id"
LOG_INFO_KEY = "prefix_gateway.log"

_JSON = b"application/json"
_STREAM_USAGE = b',"stream_options":{"include_usage":true}'


def dumps(body: Any) -> bytes:
    """Compact UTF-8 JSON; a lone surrogate (valid as a JSON escape, not as UTF-8) falls back to ``\\u`` escapes."""
    try:
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return json.dumps(body, separators=(",", ":")).encode()


def upstream_body(raw: bytes, body: dict[str, Any], plan: Plan, stream_usage: bool) -> tuple[bytes, bool]:
    """The bytes to send upstream, and whether the gateway added ``include_usage`` (→ strip it)."""
    rewritten = plan.body
    want_usage = False
    if stream_usage and plan.request.stream and plan.endpoint != "embeddings":
        options = body.get("stream_options")
        want_usage = not (isinstance(options, dict) and options.get("include_usage") is True)
    if not want_usage:
        return (raw if rewritten is None else dumps(rewritten)), False
    if rewritten is None and "stream_options" not in body:
        end = raw.rstrip().rfind(b"}")  # splice into the client's bytes: no re-serialization
        return raw[:end] + _STREAM_USAGE + raw[end:], True
    source = dict(rewritten if rewritten is not None else body)
    options = source.get("stream_options")
    injected: dict[str, Any] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    if injected.get("continuous_usage_stats"):
        # vLLM ignores continuous usage without include_usage; once we add include_usage it
        # would put usage in every chunk the client never asked for, so keep it off.
        injected["continuous_usage_stats"] = False
    source["stream_options"] = injected
    return dumps(source), True


def _is_json(content_type: str | None, data: bytes) -> bool:
    """Whether an upstream error body is already JSON (vLLM's errors are), so it passes through."""
    return bool(data) and content_type is not None and "json" in content_type.lower()


def report_failure(replica: Replica, exc: UpstreamError) -> None:
    """Passive health for a transport failure on real traffic.

    Refused, connect timeout, reset, broken or stalled: one failure each (outlier detection
    ejects on a run of them or a failure rate, never on one).  A read timeout says "slow", not
    "broken", and an abandoned wait concerns a replica already down: neither counts.
    """
    if isinstance(exc, (UpstreamReadTimeout, UpstreamAbandoned)):
        return
    replica.report_transport_error(f"{exc.kind}: {exc}")


def gateway_headers(gw: Gateway, plan: Plan, decision: Decision | None) -> list[tuple[bytes, bytes]]:
    """The gateway's own response headers: route and replica (``server.response_headers``), and
    what normalization moved (``x-prefix-gateway-normalized``: the client sees its body was rewritten)."""
    headers = []
    if gw.config.server.response_headers:
        headers.append((b"x-prefix-gateway-route", plan.route.name.encode()))
        if decision is not None:
            headers.append((b"x-prefix-gateway-replica", decision.replica.encode()))
    prepared = plan.prepared
    if prepared is not None and prepared.relocated and prepared.normalized:
        value = ",".join(f"{rule}={count}" for rule, count in prepared.normalized.items())
        headers.append((b"x-prefix-gateway-normalized", value.encode()))
    return headers


def log_fields(o: Outcome) -> dict[str, Any]:
    """What the access log line says of a request beyond method, path and time (never prompt text)."""
    info: dict[str, Any] = {"route": o.route, "replica": o.replica}
    if o.reason:
        info["reason"] = o.reason
    if o.prompt_tokens is not None:
        info["prompt_tokens"] = o.prompt_tokens
        info["cached_tokens"] = o.cached_tokens
    if o.retries:
        info["retries"] = o.retries
    if o.error_kind:
        info["error"] = o.error_kind
    if o.status == 499:
        info["status"] = 499
    if o.queued_s is not None:
        info["queued_ms"] = round(o.queued_s * 1000, 1)  # held by flow control (gateway.flow)
    if o.queued_note:
        info["queued"] = o.queued_note  # behind how many, which band and flow, placed where and why
    return info


def forward_authorization(gw: Gateway, plan: Plan | None) -> bool:
    """Whether the client's Authorization goes upstream (the route's setting, else upstream's);
    never when the gateway checks client keys: then it is the gateway's own key."""
    if gw.client_keys.enabled:
        return False
    per_route = plan.route.config.forward_client_authorization if plan is not None else None
    return gw.config.upstream.forward_client_authorization if per_route is None else per_route


class ProxyEndpoint:
    """ASGI app for one endpoint (chat, completions or embeddings)."""

    def __init__(self, gateway: Gateway, endpoint: str) -> None:
        self.gateway = gateway
        self.endpoint = endpoint
        self.path = ENDPOINT_PATHS[endpoint]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await Exchange(self, scope, receive, send).run()


class Exchange:
    """One request's journey.  Attributes are the state the stages hand forward."""

    def __init__(self, endpoint: ProxyEndpoint, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.gw = endpoint.gateway
        self.endpoint = endpoint.endpoint
        self.path = endpoint.path
        self.scope = scope
        self.receive = receive
        self.send = send
        self.t0 = perf_counter()
        self.request_id: str = scope.get(REQUEST_ID_KEY) or os.urandom(16).hex()
        self.headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        self.outcome = Outcome(route="none", endpoint=self.endpoint, status=0)
        self.plan: Plan | None = None
        self.body: dict[str, Any] | None = None  # the parsed client body (for the sample buffer)
        self.replica: Replica | None = None  # holds an in-flight slot while set
        self._attempt: Attempt | None = None  # the hold on ``replica`` (gateway.routing.attempt)
        self.decision: Decision | None = None
        self.response: UpstreamResponse | None = None
        self.usage: Usage | None = None
        self.started = False  # response headers sent to the client
        self.done = False  # final body message is being sent: a disconnect now is harmless
        self.client_gone = False
        # The final attempt's replica really served the prompt: a 2xx answer read whole, or a
        # stream's first bytes.  Only then does routing keep what it learned at decision time
        # (the affinity index and, through Redis, the peers' indexes; see PolicyRunner.release):
        # a 4xx (the replica refused the prompt), a 5xx, a transport failure or a client that
        # left before the first byte (499) leave nothing computed there.
        self.served = False
        self.t_upstream = 0.0
        self.added = 0.0
        self._watcher: asyncio.Task[None] | None = None
        self._relay: StreamRelay | None = None  # a stream being relayed (see _client_went_away)
        self.ticket: Ticket | None = None  # a per-key concurrency slot (gateway.limits)
        self.slot: Slot | None = None  # a place among server.max_concurrency (gateway.http.capacity)
        self.reservation: BodyReservation | None = None  # body bytes against server.max_buffered_body_bytes
        self.payload = b""  # the bytes sent upstream (warm restarts may keep them to replay)
        self._precharged: int | None = None  # flow control placed it and counted it on its replica already
        self.queued_s = 0.0  # time held in flow control's queue (not the gateway's own latency)
        self.priority: int | None = None  # flow-control priority, once known

    # -- driver ------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            await self._run()
        except GatewayError as exc:
            if exc.route and self.outcome.route == "none":
                self.outcome.route = exc.route
            self.outcome.status = exc.status
            self.outcome.error_kind = exc.kind
            if not self.started:
                await self._send_error(exc)
        except ClientDisconnected:
            self._client_went_away()
        except asyncio.CancelledError:
            if not self.client_gone:
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            self._client_went_away()
        except Exception:
            # A bug must still end in an OpenAI-shaped 500, not uvicorn's plain-text one.
            # Never log the body: it may hold prompt text.
            log.exception("request %s failed inside the gateway", self.request_id)
            self.outcome.status = 500
            self.outcome.error_kind = InternalError.kind
            if self.response is not None:
                self.response.abort()
            if not self.started:
                await self._send_error(InternalError(f"internal gateway error (request id {self.request_id})"))
        finally:
            if self._watcher is not None:
                self._watcher.cancel()
            self._release_unsent()
            self._finish()

    def _release_unsent(self) -> None:
        """Flow control placed the request (counted on its replica at dispatch) but it never
        reached :meth:`_hold` — the client left, or an error came first: give the room back."""
        charged, self._precharged = self._precharged, None
        plan = self.plan
        if charged is not None and plan is not None:
            Attempt(plan, plan.decision, plan.replica, charged).release(None, completed=False, served=False)

    def _client_went_away(self) -> None:
        relay = self._relay
        if relay is not None:
            self.usage = relay.usage  # what the client was sent, counted either way
            if relay.ended:
                # The official SDKs stop reading at ``[DONE]`` and close: the answer was whole,
                # so the request completed (its usage and prediction count, its replica served).
                self.done = True
                if self.response is not None:
                    self.response.abort()
                if self.replica is not None:
                    self.replica.report_ok()
                return
        self.outcome.status = 499
        self.outcome.error_kind = "client_disconnect"
        if self.response is not None:
            self.response.abort()

    async def _run(self) -> None:
        gw = self.gw
        server = gw.config.server
        # first, before anything costs memory: a full process sheds (503) instead of queueing
        self.slot = gw.capacity.enter(server.max_concurrency)
        self.reservation = gw.capacity.reservation(server.max_buffered_body_bytes)
        matched: str | None = None  # the configured key presented (its hash), whatever its spelling
        if gw.client_keys.enabled:
            matched = gw.client_keys.identify(self.headers.get("authorization"))
            if matched is None:
                raise Unauthorized("Incorrect or missing API key: send 'Authorization: Bearer <key>'.")
        if gw.limiter.enabled:
            key = gw.limit_identity.key(matched, self.scope["headers"], self.scope.get("client"))
            self.ticket = await gw.limiter.admit(key)
        raw = await read_body(
            self.receive, server.max_body_bytes, self.headers.get("content-length"), self.reservation.reserve
        )
        raw = as_utf8(raw)  # UTF-16/32 JSON becomes UTF-8: what the splice and the replica get
        self.reservation.reserve(len(raw))  # a transcoded body may have grown
        body = self.body = parse_body(raw, self.endpoint)
        if gw.config.logging.log_prompts and log.isEnabledFor(logging.DEBUG):
            log.debug("request %s body: %s", self.request_id, raw[:8192].decode("utf-8", "replace"))
        draft = gw.prepare(self.endpoint, body, self.headers, self.request_id, key_hash=matched)
        o = self.outcome
        o.route, o.policy, o.stream = draft.route.name, draft.route.policy, draft.request.stream
        if draft.prepared is not None and draft.prepared.normalized:
            o.normalize_mode, o.normalized = draft.route.normalize_mode, draft.prepared.normalized
        gw.check_context(draft, body)
        # before a wait in flow control's queue: a client that leaves there leaves the queue at once
        self._watcher = asyncio.get_running_loop().create_task(self._watch_disconnect(asyncio.current_task()))
        plan = self.plan = await self._place(draft, matched, len(raw))
        payload, strip = upstream_body(raw, body, plan, gw.config.upstream.stream_usage)
        self.payload = payload
        response = await self._send_upstream(plan, payload)
        if plan.request.stream and response.status == 200 and "event-stream" in (response.content_type or ""):
            await self._relay_stream(response, strip)
        else:
            await self._relay_whole(response)

    async def _place(self, draft: Draft, key_hash: str | None, size: int) -> Plan:
        """Decide now, or — the route saturated — wait in flow control's queue to be placed
        when a replica has room (``gateway.flow``)."""
        t = perf_counter()
        placement = await self.gw.flow.hold(draft, self.headers, key_hash, size)
        if placement is None:
            return self.gw.decide(draft)
        self.queued_s = perf_counter() - t
        if placement.charge >= 0:
            self._precharged = placement.charge  # counted on its replica at placement (see RouteFlow.place)
        self.outcome.queued_s = placement.waited_s
        self.outcome.queued_note = placement.note
        self.priority = placement.priority
        return placement.plan

    async def _watch_disconnect(self, task: asyncio.Task[Any] | None) -> None:
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                if not self.done and task is not None:
                    self.client_gone = True
                    task.cancel()
                return

    # -- upstream with retries ---------------------------------------------------------
    def _hold(self, plan: Plan, decision: Decision, replica: Replica) -> None:
        self.decision, self.replica = decision, replica
        charged, self._precharged = self._precharged, None  # placed by flow control: counted there already
        self._attempt = Attempt(plan, decision, replica, charged)  # released in _let_go
        # from now on the request has reached a replica: an abort is counted there, not as "none"
        self._note_decision()

    def _prefill_answered(self) -> None:
        """The replica sent its first byte: this request's prefill no longer queues ahead of others."""
        if self._attempt is not None:
            self._attempt.answered()

    def _let_go(self, completed: bool, served: bool = True) -> None:
        """Release the attempt's replica; ``served=False``: it did not serve the prompt (see
        ``served`` in the constructor), so what routing recorded at decision time is taken back."""
        attempt = self._attempt
        if attempt is None or self.replica is None:
            return
        self.replica = None
        usage = self.usage
        cached, prompt = (usage.cached_tokens, usage.prompt_tokens) if usage is not None else (None, None)
        attempt.release(cached, completed, served, prompt)

    def _upstream_headers(self, replica: Replica) -> dict[str, str]:
        """The client's Authorization goes upstream only where a route (or upstream) says so;
        otherwise the replica's own configured key (or none).  The headers of
        ``upstream.forward_headers`` (session id, vLLM priority) are passed on unchanged."""
        headers = {"Content-Type": "application/json", "X-Request-Id": self.request_id}
        client = self.headers
        for name in self.gw.config.upstream.forward_headers:  # X-Session-ID, X-Vllm-Priority: as sent
            value = client.get(name)
            if value is not None:
                headers[name] = value
        plan = self.plan
        if plan is not None and plan.route.config.flow_control.forward_priority:
            for name in [n for n in headers if n.lower() == "x-vllm-priority"]:
                del headers[name]  # the gateway's priority, not the client's
            headers["X-Vllm-Priority"] = vllm_priority(self._priority(plan))
        auth = self.headers.get("authorization") if self._forward_authorization() else None
        if auth:
            headers["Authorization"] = auth
        elif replica.auth_header:
            headers["Authorization"] = replica.auth_header
        return headers

    def _priority(self, plan: Plan) -> int:
        """The request's flow-control priority (known already if it was held)."""
        if self.priority is None:
            gw = self.gw
            key = gw.client_keys.identify(self.headers.get("authorization")) if gw.client_keys.enabled else None
            self.priority = gw.flow.priority_of(plan.route, self.headers, key)
        return self.priority

    def _forward_authorization(self) -> bool:
        return forward_authorization(self.gw, self.plan)

    def _next_replica(self, plan: Plan, tried: list[str]) -> tuple[Decision, Replica] | None:
        try:
            return plan.route.runner.decide(plan.request, exclude=tried)
        except NoHealthyReplica:
            return None

    async def _send_upstream(self, plan: Plan, payload: bytes) -> UpstreamResponse:
        settings = self.gw.config.upstream
        decision, replica = plan.decision, plan.replica
        tried: list[str] = []
        while True:
            self._hold(plan, decision, replica)
            self.t_upstream = perf_counter()
            try:
                response = await self._post(plan, replica, payload, tried)
            except UpstreamError as exc:
                self._let_go(completed=False, served=False)
                report_failure(replica, exc)
                tried.append(replica.name)
                following = (
                    self._next_replica(plan, tried) if exc.before_send and len(tried) <= settings.max_retries else None
                )
                if following is not None:
                    decision, replica = following
                    self.outcome.retries += 1
                    continue
                self._note_decision()
                log.warning("request %s: upstream %s failed: %s", self.request_id, tried[-1], exc)
                raise self._client_error(exc, tried=tried) from exc
            if response.status in settings.retry_on_status and len(tried) < settings.max_retries:
                following = self._next_replica(plan, [*tried, replica.name])
                if following is not None:
                    if response.status >= 500:
                        replica.report_5xx(response.status)
                    try:
                        await response.read()
                    except UpstreamError:
                        response.abort()
                    except BaseException:  # client went away (cancelled) while draining: drop it too
                        response.abort()
                        raise
                    else:
                        response.release()
                    self._let_go(completed=False, served=False)
                    tried.append(replica.name)
                    decision, replica = following
                    self.outcome.retries += 1
                    continue
            self.response = response
            self._note_decision()
            return response

    async def _post(self, plan: Plan, replica: Replica, payload: bytes, tried: list[str]) -> UpstreamResponse:
        """POST to ``replica``, but stop waiting if it goes down meanwhile and a healthy one is left.

        A frozen or ejected replica would otherwise hold the request until the read timeout
        (minutes); no byte reached the client yet, so the caller retries elsewhere.  With no
        healthy replica left (panic) waiting is the best chance, so the request stays.
        """
        task = asyncio.current_task()
        abandoned = False

        def give_up() -> None:
            nonlocal abandoned
            if abandoned or self.client_gone or task is None:
                return
            if len(tried) + 1 > self.gw.config.upstream.max_retries:
                return  # no retry left: an answer from this replica (once back) is the only one
            if not any(r.healthy and r is not replica and r.name not in tried for r in plan.route.runner.replicas):
                return
            abandoned = True
            replica.cancelled_on_down += 1
            task.cancel()

        handle = replica.on_down(give_up)
        try:
            return await replica.client.post(self.path, payload, self._upstream_headers(replica))
        except asyncio.CancelledError:
            if not abandoned or self.client_gone or task is None:
                raise
            task.uncancel()
            raise UpstreamAbandoned(
                f"replica {replica.name} went down while the request waited", before_send=True
            ) from None
        finally:
            replica.off_down(handle)

    def _note_decision(self) -> None:
        o, decision = self.outcome, self.decision
        if decision is not None:
            o.reason = decision.reason
            o.replica = decision.replica
        if self.plan is not None and decision is self.plan.decision:
            o.predicted_cached_tokens = self.plan.predicted_cached_tokens
            o.predicted_units = self.plan.predicted_units

    def _client_error(
        self, exc: UpstreamError, *, tried: list[str] | None = None, streaming: bool = False
    ) -> GatewayError:
        """The one place a transport failure becomes what the client is told.

        ``tried``: no answer started (the replicas attempted, in order); else the answer broke
        while being read, whole or (``streaming``) after the stream started.  The detail
        (addresses, ports, OS errors) went to the log; the client gets names only.
        """
        rid, name = self.request_id, self.outcome.replica
        if streaming:
            if isinstance(exc, UpstreamStalled):
                return StreamFailed(
                    f"upstream stream stalled: replica {name!r} sent nothing for "
                    f"{self.gw.config.upstream.stream_idle_timeout_s:g} s (request id {rid})",
                    code="upstream_stream_idle_timeout",
                )
            return StreamFailed(f"upstream stream failed: replica {name!r} (request id {rid})")
        timed_out = isinstance(exc, UpstreamReadTimeout)
        if tried is None:
            message = f"replica {name!r} failed while answering (request id {rid})"
            return GatewayTimeout(message) if timed_out else BadGateway(message)
        if timed_out:
            return GatewayTimeout(f"replica {tried[-1]!r} did not answer in time (request id {rid})")
        route = self.plan.route if self.plan is not None else None
        if route is not None and route.runner.healthy_count() == 0:
            return NoHealthyReplica(
                f"no healthy replica for route {route.name!r}: every attempt failed "
                f"({', '.join(tried)}; request id {rid})"
            )
        return BadGateway(f"could not get an answer from {', '.join(tried)} (request id {rid})")

    # -- relaying ----------------------------------------------------------------------
    def _response_headers(self, content_type: bytes) -> list[tuple[bytes, bytes]]:
        headers = [(b"content-type", content_type)]
        if self.plan is not None:
            headers.extend(gateway_headers(self.gw, self.plan, self.decision))
        return headers

    async def _relay_whole(self, response: UpstreamResponse) -> None:
        replica = self.replica
        try:
            data = await response.read()
        except UpstreamError as exc:
            response.abort()
            if replica is not None:
                report_failure(replica, exc)
            log.warning("request %s: replica %s failed while answering: %s", self.request_id, self.outcome.replica, exc)
            raise self._client_error(exc) from exc
        response.release()
        status = response.status
        t_back = perf_counter()
        if replica is not None:
            if status >= 500:
                replica.report_5xx(status)
            else:
                replica.report_ok()
        self.served = 200 <= status < 300
        if status == 200:
            self.usage = sniff_json_usage(data)
        else:
            self.outcome.error_kind = "upstream_status"
        content_type = (response.content_type or "application/json").encode("latin-1")
        if status >= 300 and not _is_json(response.content_type, data):
            data = self._shape_upstream_error(status)
            status, content_type = (502 if status < 400 else status), _JSON
        headers = self._response_headers(content_type)
        headers.append((b"content-length", str(len(data)).encode()))
        self.outcome.status = status
        self.started = True
        await self.send({"type": "http.response.start", "status": status, "headers": headers})
        self.done = True
        await self.send({"type": "http.response.body", "body": data, "more_body": False})
        self.added = (self.t_upstream - self.t0 - self.queued_s) + (perf_counter() - t_back)

    def _shape_upstream_error(self, status: int) -> bytes:
        """An OpenAI-shaped body for a replica's bare non-2xx answer (empty, HTML, a redirect).

        A redirect is never passed on: its Location names a host behind the gateway, and an
        SDK following it would send the prompt there.
        """
        name, rid = self.outcome.replica, self.request_id
        if status < 400:
            self.outcome.error_kind = RedirectRefused.kind
            message = f"replica {name!r} answered with a redirect (HTTP {status}; request id {rid})"
            return RedirectRefused(message).to_bytes()
        return error_bytes(status, f"replica {name!r} answered HTTP {status} (request id {rid})")

    async def _relay_stream(self, response: UpstreamResponse, strip: bool) -> None:
        relay = self._relay = StreamRelay(strip)
        send = self.send
        content_type = (response.content_type or "text/event-stream").encode("latin-1")
        self.outcome.status = 200
        self.started = True
        await send({"type": "http.response.start", "status": 200, "headers": self._response_headers(content_type)})
        first = True
        idle_s = self.gw.config.upstream.stream_idle_timeout_s
        loop = asyncio.get_running_loop()
        try:
            # Until the first chunk the replica may be queueing or prefilling (read_timeout_s
            # covers that); after it, a silence longer than idle_s is a stalled stream.  The
            # deadline is off while a chunk is handed to the client: a slow reader is not a stall.
            async with asyncio.timeout(None) as deadline:
                async for data in response.chunks():
                    deadline.reschedule(None)
                    out = relay.feed(data)
                    if out:
                        if first:
                            t_in = perf_counter()
                            self.served = True  # its first bytes: the replica computed the prompt
                            self._prefill_answered()  # the replica is done prefilling, however slow the client
                            attempt = self._attempt
                            if self.replica is not None and attempt is not None:
                                self.replica.record_ttfb(t_in - self.t_upstream, attempt.work_tokens)
                        await send({"type": "http.response.body", "body": out, "more_body": True})
                        if first:
                            now = perf_counter()
                            self.outcome.ttft_s = now - self.t0
                            self.added = (self.t_upstream - self.t0 - self.queued_s) + (now - t_in)
                            first = False
                    deadline.reschedule(loop.time() + idle_s)
        except (UpstreamError, TimeoutError) as caught:
            exc = caught if isinstance(caught, UpstreamError) else UpstreamStalled(f"no data for {idle_s:g} s")
            await self._fail_stream(response, relay, exc)
            return
        self.usage = relay.usage
        tail = relay.finish()
        response.release()
        if self.replica is not None:
            self.replica.report_ok()
        self.done = True
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    async def _fail_stream(self, response: UpstreamResponse, relay: StreamRelay, exc: UpstreamError) -> None:
        """End a started stream with an OpenAI-style error event, never a silent hang or cut."""
        response.abort()
        self.usage = relay.usage
        self.outcome.error_kind = f"upstream_{exc.kind}"
        if self.replica is not None:
            report_failure(self.replica, exc)
        log.warning("request %s: stream from replica %s failed: %s", self.request_id, self.outcome.replica, exc)
        error = self._client_error(exc, streaming=True)
        self.done = True
        event = b"data: " + error.to_bytes() + b"\n\n"
        await self.send({"type": "http.response.body", "body": event, "more_body": False})

    async def _send_error(self, exc: GatewayError) -> None:
        body = exc.to_bytes()
        headers = self._response_headers(_JSON)
        headers.append((b"content-length", str(len(body)).encode()))
        headers.extend(getattr(exc, "headers", ()))  # e.g. retry-after on a 429
        self.started = True
        self.done = True
        await self.send({"type": "http.response.start", "status": exc.status, "headers": headers})
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    # -- bookkeeping -------------------------------------------------------------------
    def _finish(self) -> None:
        # the body stays referenced (payload, samples, warm restarts) until here: held until here
        self.gw.release_admission(self.slot, self.reservation, self.ticket)
        self.ticket = None
        o = self.outcome
        completed = o.status == 200 and o.error_kind is None
        self._let_go(completed, served=self.served)
        if o.status == 0:
            o.status = 500
        usage = self.usage
        if usage is not None:
            o.take_usage(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
        if self.added:
            o.added_s = self.added
        o.duration_s = perf_counter() - self.t0
        self.gw.record(o, self.plan, self.body)
        if completed and self.plan is not None and o.replica:
            self.gw.warmer.remember(self.plan.route, o.replica, self.plan.request, self.payload)
        info = self.scope.get(LOG_INFO_KEY)
        if info is not None:
            info.update(log_fields(o))
