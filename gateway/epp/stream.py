"""One ext_proc stream (one HTTP request through Envoy): the picker's state machine.

Envoy sends, in order, the request headers, the request body in chunks (``FULL_DUPLEX_STREAMED``),
maybe request trailers, then the response headers, body chunks and trailers.  The picker:

- holds the request headers' answer until the body is whole, then parses it
  (``gateway.proxy.parse``), plans it exactly as ``serve`` does (``Gateway.plan``: route,
  normalize, key, decide), and answers the headers with the pick — the
  ``x-gateway-destination-endpoint`` header and ``envoy.lb`` metadata, the primary then
  fallbacks — and the body with the bytes the replica must get (rewritten when the route
  normalizes, ``include_usage`` added for streams, as the proxy does: ``upstream_body``);
- on the response headers, learns which endpoint served (``x-gateway-destination-endpoint-served``):
  when Envoy retried on a fallback, what routing recorded for the pick is taken back and the
  served replica is credited instead, as the proxy's own retries do;
- relays the response body, reading usage (``cached_tokens``) from the SSE stream or the JSON
  body, so predicted and reported hit rates are counted as in proxy mode;
- answers every error before the response as an immediate response in OpenAI's error shape.

:meth:`PickerStream.handle` takes one ``ProcessingRequest`` and returns the responses to
send; :meth:`PickerStream.close` runs once when the stream ends, however it ends.  No gRPC
here: tests drive it with hand-made messages.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from time import perf_counter
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from gateway.epp import messages as m
from gateway.epp.endpoints import endpoint_of, find, outside
from gateway.errors import (
    BadRequest,
    GatewayError,
    InternalError,
    NoHealthyReplica,
    PayloadTooLarge,
    Unauthorized,
    error_bytes,
)
from gateway.flow.classify import vllm_priority
from gateway.flow.gate import Placement
from gateway.http.capacity import BodyReservation, Slot
from gateway.limits.admission import Ticket
from gateway.observe.outcome import Outcome
from gateway.proxy.handler import dumps, forward_authorization, gateway_headers, log_fields, upstream_body
from gateway.proxy.parse import as_utf8, parse_body
from gateway.proxy.usage import StreamRelay, Usage, sniff_json_usage
from gateway.routing.attempt import Attempt
from gateway.routing.plan import Plan
from gateway.service import ENDPOINT_PATHS, Gateway

log = logging.getLogger("prefix_gateway.epp")

PATH_ENDPOINTS = {path: endpoint for endpoint, path in ENDPOINT_PATHS.items()}
#: bytes of a whole (non-streamed) response kept to find its usage object, which ends the body
USAGE_TAIL_BYTES = 16_384
_REMOVE_SERVED = (m.SERVED,)


class PickerStream:
    """The state of one request through Envoy; see the module docstring."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.t0 = perf_counter()
        self.t_sent = self.t0  # when the pick went to Envoy (the replica's time to first byte starts there)
        self.outcome = Outcome(route="none", endpoint="", status=0)
        self.headers: dict[str, str] = {}
        self.request_id = ""
        self.endpoint: str | None = None  # chat / completions / embeddings; None: passed through unrouted
        self.phase = "start"  # start → body → response → done
        self._chunks: list[bytes] = []
        self._size = 0
        self.subset: list[str] | None = None  # the data plane's subset hint (endpoints)
        self.plan: Plan | None = None
        self.body: dict[str, Any] | None = None
        self.payload = b""
        self.strip = False  # the picker added include_usage: the relay takes it out again
        self.attempt: Attempt | None = None
        self.status = 0
        self.relay: StreamRelay | None = None
        self._tail = b""
        self.usage: Usage | None = None
        self.served = False  # the replica that served answered 2xx (whole) or sent stream bytes
        self.shape_error = False  # a bare (non-JSON) error answer: replaced by an OpenAI-shaped one
        self.slot: Slot | None = None
        self.reservation: BodyReservation | None = None
        self.ticket: Ticket | None = None
        self._matched_key: str | None = None  # the client key presented (its hash), for per-key limits
        self.finished = False  # the response ended (or an immediate response was sent)
        self._closed = False

    # -- dispatch ----------------------------------------------------------------------
    async def handle(self, message: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        kind = message.WhichOneof("request")
        try:
            if kind == "request_headers":
                return await self._request_headers(message)
            if kind == "request_body":
                return await self._request_body(message.request_body)
            if kind == "request_trailers":
                return await self._request_trailers()
            if kind == "response_headers":
                return self._response_headers(message)
            if kind == "response_body":
                return self._response_body(message.response_body)
            if kind == "response_trailers":
                return self._response_trailers()
            raise InternalError(f"malformed ext_proc message: no known part set ({kind or 'empty'})")
        except GatewayError as exc:
            return self._fail(exc)

    def _expect(self, *phases: str) -> None:
        if self.phase not in phases:
            raise InternalError(f"malformed ext_proc stream: message out of order (in phase {self.phase!r})")

    def _fail(self, exc: GatewayError) -> list[ep.ProcessingResponse]:
        """An immediate response in OpenAI's shape — while the request phase lasts; once the
        replica's answer started, it is raised on: the servicer ends the gRPC stream (Envoy resets)."""
        if exc.route and self.outcome.route == "none":
            self.outcome.route = exc.route
        self.outcome.status, self.outcome.error_kind = exc.status, exc.kind
        if self.phase in ("response", "done"):
            raise exc
        self.phase, self.finished = "done", True
        return [m.immediate_error(exc)]

    def internal_error(self) -> list[ep.ProcessingResponse]:
        """A bug in the picker: an OpenAI-shaped 500 before the response, else nothing to send."""
        if self.phase in ("response", "done"):
            return []
        return self._fail(InternalError(f"internal picker error (request id {self.request_id})"))

    # -- request -----------------------------------------------------------------------
    async def _request_headers(self, message: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        self._expect("start")
        self.phase = "body"
        headers = self.headers = m.header_map(message.request_headers.headers)
        self.request_id = headers.get("x-request-id") or os.urandom(16).hex()
        self._note_subset(message)
        path = headers.get(":path", "").split("?", 1)[0]
        method = headers.get(":method", "")
        if method == "GET" and path == "/v1/models":
            return await self._models()
        endpoint = PATH_ENDPOINTS.get(path) if method == "POST" else None
        if endpoint is None:
            # not an inference request: passed on as it is; Envoy's fallback policy chooses
            self.endpoint = None
            return [m.continue_request_headers()]
        self.endpoint = self.outcome.endpoint = endpoint
        self._admit()
        if self.gw.limiter.enabled:
            matched = self._matched_key
            client = headers.get("x-envoy-external-address")
            raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
            key = self.gw.limit_identity.key(matched, raw, (client, 0) if client else None)
            self.ticket = await self.gw.limiter.admit(key)  # 429 with retry-after
        limit = self.gw.config.server.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {limit} bytes")
        if message.request_headers.end_of_stream:
            raise BadRequest("request body is empty; expected a JSON object", code="invalid_json")
        return []  # the headers are answered with the pick, once the body is whole

    def _admit(self) -> None:
        """What the proxy checks before reading a body: process caps (503) and the client key (401)."""
        gw, server = self.gw, self.gw.config.server
        self.slot = gw.capacity.enter(server.max_concurrency)
        self.reservation = gw.capacity.reservation(server.max_buffered_body_bytes)
        if gw.client_keys.enabled:
            self._matched_key = gw.client_keys.identify(self.headers.get("authorization"))
            if self._matched_key is None:
                raise Unauthorized("Incorrect or missing API key: send 'Authorization: Bearer <key>'.")

    async def _models(self) -> list[ep.ProcessingResponse]:
        """``GET /v1/models`` is answered by the picker: the union of what healthy replicas serve
        and some route accepts — the same list ``serve`` gives, never one replica's own."""
        gw = self.gw
        if gw.client_keys.enabled and not gw.client_keys.check_authorization(self.headers.get("authorization")):
            raise Unauthorized("Incorrect or missing API key: send 'Authorization: Bearer <key>'.")
        body = dumps({"object": "list", "data": await gw.models()})
        self.phase, self.finished = "done", True
        return [m.immediate(200, body)]

    def _note_subset(self, message: ep.ProcessingRequest) -> None:
        subset = m.metadata_strings(message, m.SUBSET_NAMESPACE, m.SUBSET)
        if subset is None:
            header = self.headers.get(m.SUBSET)
            subset = m.split_endpoints(header) if header is not None else None
        if subset is not None:
            self.subset = subset

    async def _request_body(self, body: ep.HttpBody) -> list[ep.ProcessingResponse]:
        self._expect("body")
        if self.endpoint is None:
            return m.request_body(body.body, body.end_of_stream)
        if body.body:
            self._size += len(body.body)
            limit = self.gw.config.server.max_body_bytes
            if self._size > limit:
                raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
            if self.reservation is not None:
                self.reservation.reserve(self._size)
            self._chunks.append(body.body)
        if not body.end_of_stream:
            return []
        return await self._pick()

    async def _request_trailers(self) -> list[ep.ProcessingResponse]:
        self._expect("body", "response")
        out = await self._pick() if self.phase == "body" and self.endpoint is not None else []
        out.append(m.request_trailers())
        return out

    async def _pick(self) -> list[ep.ProcessingResponse]:
        t_pick = perf_counter()
        gw = self.gw
        chunks = self._chunks
        raw = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        raw = as_utf8(raw)
        if self.reservation is not None:
            self.reservation.reserve(len(raw))
        assert self.endpoint is not None
        body = self.body = parse_body(raw, self.endpoint)
        if gw.config.logging.log_prompts and log.isEnabledFor(logging.DEBUG):
            log.debug("request %s body: %s", self.request_id, raw[:8192].decode("utf-8", "replace"))
        draft = gw.prepare(self.endpoint, body, self.headers, self.request_id, key_hash=self._matched_key)
        o = self.outcome
        o.route, o.policy, o.stream = draft.route.name, draft.route.policy, draft.request.stream
        if draft.prepared is not None and draft.prepared.normalized:
            o.normalize_mode, o.normalized = draft.route.normalize_mode, draft.prepared.normalized
        gw.check_context(draft, body)
        t_held = perf_counter()
        # the route saturated: held in flow control's queue, placed when a replica has room (Envoy
        # waits for the headers' answer meantime; a stream it resets leaves the queue at once)
        placement = await gw.flow.hold(draft, self.headers, self._matched_key, len(raw))
        charged: int | None = None
        if placement is None:
            plan = gw.decide(draft)
        else:
            plan = placement.plan
            charged = placement.charge if placement.charge >= 0 else None  # counted there already
            o.queued_s, o.queued_note = placement.waited_s, placement.note
            t_pick += perf_counter() - t_held  # the wait is not the picker's own time
        exclude = self._outside_subset(plan, charged)
        if exclude and plan.replica.name in exclude:
            plan, charged = self._repick(plan, exclude, charged), None
        self.plan = plan
        self.attempt = Attempt(plan, plan.decision, plan.replica, charged)  # released by close(), whatever follows
        payload, self.strip = upstream_body(raw, body, plan, gw.config.upstream.stream_usage)
        self.payload = payload
        o.reason, o.replica = plan.decision.reason, plan.decision.replica
        o.predicted_cached_tokens, o.predicted_units = plan.predicted_cached_tokens, plan.predicted_units
        endpoints = [endpoint_of(plan.replica.url), *self._fallbacks(plan, exclude)]
        self.phase = "response"
        extra = [*self._auth_headers(plan), *self._priority_header(plan, placement)]
        out = [m.pick_headers(",".join(endpoints), len(payload), extra, self._auth_removed(plan))]
        out.extend(m.request_body(payload, True))
        self.t_sent = perf_counter()
        o.added_s = self.t_sent - t_pick
        return out

    def _outside_subset(self, plan: Plan, charged: int | None = None) -> list[str]:
        if self.subset is None:
            return []
        names = outside(plan.route.runner.replicas, self.subset)
        if len(names) == len(plan.route.runner.replicas):
            # the protocol: nothing eligible in the hint (or an empty hint) → 503
            self._take_back(plan, charged)
            error = NoHealthyReplica(
                f"none of the endpoints the data plane allows ({', '.join(self.subset) or 'none'}) "
                f"is a replica of route {plan.route.name!r}"
            )
            error.route = plan.route.name
            raise error
        return names

    def _take_back(self, plan: Plan, charged: int | None = None) -> None:
        """Undo what deciding ``plan`` recorded (an attempt that never served); ``charged``: flow
        control acquired its replica already, with that prefill charge."""
        Attempt(plan, plan.decision, plan.replica, charged).release(None, completed=False, served=False)

    def _repick(self, plan: Plan, exclude: list[str], charged: int | None = None) -> Plan:
        """The plan's pick is outside the subset hint: taken back, and picked again inside it."""
        self._take_back(plan, charged)
        decision, replica = plan.route.runner.decide(plan.request, exclude=exclude)  # 503 when none is healthy
        return dataclasses.replace(plan, decision=decision, replica=replica)

    def _fallbacks(self, plan: Plan, exclude: list[str]) -> list[str]:
        """Where Envoy goes next if the pick fails before answering (``upstream.max_retries`` of
        them): the least loaded other healthy replicas.  Not the policy's next choices: a dry-run
        decide per fallback cost more than the rest of the pick (measured), and no replica but the
        pick holds the prompt's prefix anyway.  Envoy only uses them on a refused or reset
        connection; the served endpoint then tells routing where the prompt really went."""
        count = self.gw.config.upstream.max_retries
        if not count:
            return []
        skip = {plan.replica.name, *exclude}
        others = [r for r in plan.route.runner.replicas if r.healthy and r.name not in skip]
        others.sort(key=lambda r: (r.in_flight, r.pending_prefill_tokens))
        return [endpoint_of(r.url) for r in others[:count]]

    def _priority_header(self, plan: Plan, placement: Placement | None) -> list[tuple[str, bytes]]:
        """``X-Vllm-Priority`` for a route that forwards flow control's priority (set: what the
        client sent is replaced, as in proxy mode)."""
        if not plan.route.config.flow_control.forward_priority:
            return []
        if placement is not None:
            priority = placement.priority
        else:
            priority = self.gw.flow.priority_of(plan.route, self.headers, self._matched_key)
        return [("x-vllm-priority", vllm_priority(priority).encode())]

    def _auth_headers(self, plan: Plan) -> list[tuple[str, bytes]]:
        if forward_authorization(self.gw, plan):
            return []
        auth = plan.replica.auth_header
        return [("authorization", auth.encode("latin-1"))] if auth else []

    def _auth_removed(self, plan: Plan) -> list[str]:
        """The client's Authorization never reaches a replica unless forwarding is configured."""
        if forward_authorization(self.gw, plan) or plan.replica.auth_header:
            return []
        return ["authorization"] if "authorization" in self.headers else []

    # -- response ----------------------------------------------------------------------
    def _response_headers(self, message: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        self._expect("response", "body")
        headers = m.header_map(message.response_headers.headers)
        if self.plan is None:  # passed through unrouted
            self.phase = "response"
            return [m.response_headers(_REMOVE_SERVED)]
        try:
            self.status = int(headers.get(":status", "0"))
        except ValueError:
            self.status = 0
        self.outcome.status = self.status
        served = m.metadata_strings(message, m.LB_NAMESPACE, m.SERVED)
        if not served:
            header = headers.get(m.SERVED)
            served = m.split_endpoints(header) if header else None
        self._served_by(served[0] if served else None)
        replica = self.attempt.replica if self.attempt is not None else None
        status = self.status
        if replica is not None:
            if status >= 500:
                replica.report_5xx(status)
            elif status:
                replica.report_ok()
        content_type = headers.get("content-type", "")
        if status == 200 and self.plan.request.stream and "event-stream" in content_type:
            self.relay = StreamRelay(self.strip)
        elif status >= 300:
            self.outcome.error_kind = "upstream_status"
            self.shape_error = "json" not in content_type.lower()
        out = [self._error_headers()] if self.shape_error else [m.response_headers(_REMOVE_SERVED)]
        decision = self.attempt.decision if self.attempt is not None else None
        added = gateway_headers(self.gw, self.plan, decision)
        if added:
            mutation = out[0].response_headers.response.header_mutation
            mutation.set_headers.extend(m.set_header(k.decode("latin-1"), v) for k, v in added)
        if message.response_headers.end_of_stream:
            self._response_done()
        return out

    def _served_by(self, endpoint: str | None) -> None:
        """Credit the replica that really served (Envoy may have retried on a fallback)."""
        attempt, plan = self.attempt, self.plan
        if attempt is None or plan is None or endpoint is None or endpoint == endpoint_of(attempt.replica.url):
            return
        # the pick did not serve: Envoy moved on (a refused or reset connection: the retry policy)
        attempt.replica.report_transport_error(f"the data plane served request {self.request_id} elsewhere")
        attempt.release(None, completed=False, served=False)
        self.attempt = None
        self.outcome.retries += 1
        runner = plan.route.runner
        replica = find(runner.replicas, endpoint)
        if replica is None:
            self.outcome.replica = None
            log.warning(
                "request %s was served by %s, not a replica of route %s", self.request_id, endpoint, plan.route.name
            )
            return
        others = [r.name for r in runner.replicas if r is not replica]
        try:  # the proxy's retry path: decided afresh among the one that served, so routing learns it
            decision, replica = runner.decide(plan.request, exclude=others)
        except NoHealthyReplica:
            return
        self.attempt = Attempt(plan, decision, replica)
        self.outcome.replica, self.outcome.reason = decision.replica, decision.reason

    def _error_headers(self) -> ep.ProcessingResponse:
        response = m.response_headers((*_REMOVE_SERVED, "content-length"))
        mutation = response.response_headers.response.header_mutation
        mutation.set_headers.append(m.set_header("content-type", b"application/json"))
        return response

    def _response_body(self, body: ep.HttpBody) -> list[ep.ProcessingResponse]:
        self._expect("response")
        end = body.end_of_stream
        if self.plan is None:
            return m.response_body(body.body, end)
        data = body.body
        relay = self.relay
        if relay is not None:
            out = relay.feed(data)
            if out and not self.served:
                self._first_bytes()
            if end:
                out += relay.finish()
                self.usage = relay.usage
        elif self.shape_error:
            out = b""
            if end:
                name = self.outcome.replica or "?"
                out = error_bytes(
                    self.status, f"replica {name!r} answered HTTP {self.status} (request id {self.request_id})"
                )
        else:
            tail = self._tail + data if self._tail else data
            self._tail = tail[-USAGE_TAIL_BYTES:]
            out = data
            if end and self.status == 200:
                self.usage = sniff_json_usage(self._tail)
        if end:
            self._response_done()
        return m.response_body(out, end)

    def _first_bytes(self) -> None:
        self.served = True
        attempt = self.attempt
        if attempt is not None:
            attempt.answered()
            attempt.replica.record_ttfb(perf_counter() - self.t_sent, attempt.work_tokens)  # from the pick
        self.outcome.ttft_s = perf_counter() - self.t0

    def _response_trailers(self) -> list[ep.ProcessingResponse]:
        self._expect("response", "done")
        if self.phase == "response" and self.plan is not None:
            self._response_done()
        return [m.response_trailers()]

    def _response_done(self) -> None:
        self.phase, self.finished = "done", True
        if self.relay is None and 200 <= self.status < 300:
            self.served = True

    # -- end -------------------------------------------------------------------------
    def close(self) -> None:
        """The stream ended (answered, failed, or cut by Envoy when the client left): release
        everything held and count the request once."""
        if self._closed:
            return
        self._closed = True
        o = self.outcome
        if not self.finished and self.endpoint is not None:
            relay = self.relay
            if relay is not None:
                self.usage = relay.usage
            if relay is not None and relay.ended:
                self.finished = True  # the client had the whole answer ([DONE]) before it closed
            else:
                o.status, o.error_kind = 499, "stream_cut"  # Envoy cut the stream: the client left, or it failed
        self.gw.release_admission(self.slot, self.reservation, self.ticket)
        self.ticket = None
        completed = self.finished and o.status == 200 and o.error_kind is None
        if self.attempt is not None:
            usage = self.usage
            cached, prompt = (usage.cached_tokens, usage.prompt_tokens) if usage is not None else (None, None)
            self.attempt.release(cached, completed, self.served, prompt)
        if self.endpoint is None:
            return  # not an inference request: not counted (as the proxy does not count them)
        if o.status == 0:
            o.status = 500
        usage = self.usage
        if usage is not None:
            o.take_usage(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
        o.duration_s = perf_counter() - self.t0
        self.gw.record(o, self.plan, self.body)
        access = self.gw.access_log
        path = self.headers.get(":path", "")
        if access.wants(path):
            client = self.headers.get("x-envoy-external-address") or self.headers.get("x-forwarded-for") or "-"
            info = log_fields(o)
            status = info.pop("status", o.status)
            access.write(client, self.headers.get(":method", ""), path, status, o.duration_s, self.request_id, info)
        if completed and self.plan is not None and o.replica:
            self.gw.warmer.remember(self.plan.route, o.replica, self.plan.request, self.payload)
