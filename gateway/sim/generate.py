"""``POST /v1/chat/completions`` and ``POST /v1/completions``, streaming or not.

The path of a request: parse → tokenize (the project's chat template) → plan the output
length → engine request(s) with their block keys → wait (or not, at time_scale 0) →
render the OpenAI/vLLM response.  Usage reports what the engine really did:
``cached_tokens`` is the prefix-cache hit found when the request was first admitted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from gateway.sim.asgi import Receive, Send, start_stream, watch_disconnect
from gateway.sim.engine import EngineError, EngineRequest
from gateway.sim.faults import FaultSettings
from gateway.sim.protocol import (
    SSE_DONE,
    APIError,
    ChatRequest,
    CompletionRequest,
    check_messages,
    check_token_ids,
    parse,
    sse,
    usage,
)
from gateway.sim.replica import Replica
from gateway.sim.sampling import check_sampling

logger = logging.getLogger("gateway.sim.api")

_dumps = json.JSONEncoder(separators=(",", ":")).encode


class _Job:
    """One HTTP generation request: its prompts, its engine requests, how to render it."""

    __slots__ = (
        "cache_salt",
        "chat",
        "created",
        "echo",
        "lora",
        "model",
        "n",
        "prompts",
        "reqs",
        "rid",
        "stream_usage",
        "texts",
    )

    def __init__(
        self,
        chat: bool,
        model: str,
        rid: str,
        prompts: list[list[int]],
        n: int,
        lora: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.chat = chat
        self.lora = lora
        self.cache_salt = cache_salt
        self.model = model
        self.rid = rid
        self.prompts = prompts
        self.n = n
        self.reqs: list[EngineRequest] = []
        self.created = int(time.time())
        self.echo: list[str] | None = None
        self.texts: list[str] | None = None  # completions' prompts given as text
        self.stream_usage: tuple[bool, bool] = (False, False)  # include_usage, continuous


async def chat_completions(replica: Replica, body: bytes, receive: Receive, send: Send) -> tuple[int, bytes] | None:
    req: ChatRequest = parse(ChatRequest, body)
    model, lora = replica.resolve_model(req.model)
    seed = replica.block_seed(lora, req.cache_salt)
    check_messages(req.messages)
    _check_tool_choice(replica, req)
    # vLLM checks max_tokens against max_model_len before it renders the prompt
    if req.max_completion_tokens is not None:
        requested: int | None = req.max_completion_tokens
        replica.check_max_tokens(requested, "max_completion_tokens")
    else:
        requested = req.max_tokens
        replica.check_max_tokens(requested)
    prompt = replica.prompts.chat(req.messages, req.tools, req.add_generation_prompt)
    job = _Job(True, model, "chatcmpl-" + replica.new_id(), [prompt], req.n, lora, req.cache_salt)
    return await _generate(replica, job, req, requested, seed, "messages", receive, send)


def _check_tool_choice(replica: Replica, req: ChatRequest) -> None:
    """vLLM without a tool parser refuses the tool choices that need one."""
    if replica.options.enable_auto_tool_choice or not req.tools:
        return
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    if choice == "none":
        return
    if choice == "auto":
        raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
    named = isinstance(choice, dict)
    desc = f'function "{(choice.get("function") or {}).get("name")}"' if named else f'"{choice}"'  # type: ignore[union-attr]
    raise APIError(400, f"tool_choice={desc} requires --tool-call-parser to be set")


async def completions(replica: Replica, body: bytes, receive: Receive, send: Send) -> tuple[int, bytes] | None:
    req: CompletionRequest = parse(CompletionRequest, body)
    model, lora = replica.resolve_model(req.model)
    seed = replica.block_seed(lora, req.cache_salt)
    replica.check_max_tokens(req.max_tokens)
    raw = req.prompt
    prompts: list[list[int]]
    texts: list[str] | None = None
    if isinstance(raw, str):
        texts = [raw]
        prompts = [replica.prompts.completion(raw)]
    elif not raw:
        raise APIError(400, "Prompt cannot be empty.", param="prompt")
    elif isinstance(raw[0], int):
        prompts = [list(raw)]  # type: ignore[arg-type]
    elif isinstance(raw[0], str):
        texts = list(raw)  # type: ignore[arg-type]
        prompts = [replica.prompts.completion(t) for t in texts]
    else:
        prompts = [list(p) for p in raw]  # type: ignore[union-attr]
    for ids in prompts:
        if not ids:
            raise APIError(400, "Prompt cannot be empty.", param="prompt")
        check_token_ids(ids, "prompt")
    job = _Job(False, model, "cmpl-" + replica.new_id(), prompts, req.n, lora, req.cache_salt)
    job.texts = texts
    if req.echo:
        job.echo = texts if texts is not None else [replica.tokenizer.decode(p) for p in prompts]
    return await _generate(replica, job, req, req.max_tokens, seed, "prompt", receive, send)


async def _generate(
    replica: Replica,
    job: _Job,
    req: ChatRequest | CompletionRequest,
    requested: int | None,
    seed: int,
    what: str,
    receive: Receive,
    send: Send,
) -> tuple[int, bytes] | None:
    arrival = time.monotonic()
    for prompt in job.prompts:
        out_len, reason = replica.output_plan(len(prompt), requested, what, text=job.chat or job.texts is not None)
        check_sampling(req, out_len, job.n)
        job.reqs.extend(
            replica.engine_requests(
                prompt, out_len, reason, job.n, seed, arrival, lora=job.lora, cache_salt=job.cache_salt
            )
        )
    engine = replica.engine
    if req.stream:
        opts = req.stream_options
        include = bool(opts and opts.include_usage)
        # like vLLM: continuous usage only together with include_usage
        job.stream_usage = (include, include and bool(opts and opts.continuous_usage_stats))
        return await _stream(replica, job, receive, send)
    if engine.instant:
        _start(replica, job.reqs)
    else:
        waiter = asyncio.Event()
        for r in job.reqs:
            r.waiter = waiter
        _start(replica, job.reqs)
        if not await _wait_all(replica, job.reqs, waiter, receive):
            return None  # client gone: nothing to send
        for r in job.reqs:
            if r.error:
                raise APIError(503, r.error)
    return 200, _dumps(_response(replica, job)).encode()


async def _wait_all(replica: Replica, reqs: list[EngineRequest], waiter: asyncio.Event, receive: Receive) -> bool:
    """Wait until every request finished; abort them all (and say False) if the client leaves."""
    gone = _watch(receive, waiter)
    try:
        while not all(r.finished for r in reqs):
            await waiter.wait()
            waiter.clear()
            if gone.done():
                for r in reqs:
                    replica.engine.abort(r)
                return False
        return True
    finally:
        gone.cancel()


def _watch(receive: Receive, waiter: asyncio.Event) -> asyncio.Future[Any]:
    """Watch for the client leaving; it wakes the same event the engine sets (one wait, no races)."""
    gone = watch_disconnect(receive)
    gone.add_done_callback(lambda _: waiter.set())
    return gone


def _usage(replica: Replica, job: _Job, completion: int | None = None, *, stream: bool = False) -> dict[str, Any]:
    reqs = job.reqs
    n = job.n
    prompt_tokens = sum(len(p) for p in job.prompts)
    if completion is None:
        completion = sum(r.num_output for r in reqs)
    cached: int | None = None
    created: int | None = None
    if replica.options.enable_prompt_tokens_details:
        firsts = [reqs[i * n] for i in range(len(job.prompts))]
        cached = sum(max(r.cached_tokens, 0) for r in firsts)
        if job.chat:
            created = sum(_created_cache_tokens(r, replica.block_size) for r in firsts)
    return usage(prompt_tokens, completion, cached, created, stream=stream)


def _created_cache_tokens(req: EngineRequest, block_size: int) -> int:
    """vLLM 0.32's ``created_cache_tokens``: the prompt tokens in full blocks cached once the
    prompt is computed, less those that were already cached (``PrefillStats.finalize``)."""
    full = req.num_prompt // block_size * block_size
    return max(0, full - max(req.cached_tokens, 0))


def _response(replica: Replica, job: _Job) -> dict[str, Any]:
    render = replica.textgen.render
    choices: list[dict[str, Any]] = []
    for index, r in enumerate(job.reqs):
        text = render(r.output)
        if job.chat:
            choices.append(
                {
                    "index": index,
                    "message": {**_MESSAGE, "content": text},  # vLLM 0.32 omits empty tool_calls
                    "logprobs": None,
                    "finish_reason": r.finish_reason,
                    "stop_reason": None,
                    "token_ids": None,
                    "routed_experts": None,
                }
            )
        else:
            if job.echo is not None:
                text = job.echo[index // job.n] + text
            choices.append(
                {
                    "index": index,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": r.finish_reason,
                    "stop_reason": None,
                    "token_ids": None,
                    "prompt_logprobs": None,
                    "prompt_token_ids": None,
                    "routed_experts": None,
                }
            )
    body: dict[str, Any] = {
        "id": job.rid,
        "object": "chat.completion" if job.chat else "text_completion",
        "created": job.created,
        "model": job.model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": replica.fingerprint,
        "usage": _usage(replica, job),
    }
    if job.chat:
        body.update(prompt_logprobs=None, prompt_token_ids=None, prompt_text=None)
    body.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
    return body


# vLLM 0.32's assistant message with nothing but content
_MESSAGE: dict[str, Any] = {
    "role": "assistant",
    "content": "",
    "refusal": None,
    "annotations": None,
    "audio": None,
    "function_call": None,
    "reasoning": None,
}


# -- streaming --------------------------------------------------------------------------------


class _Dropped(Exception):
    """Fault injection: lose the connection now."""


class _Stalled(Exception):
    """Fault injection: stop sending, keep the connection open."""


class _ChunkSink:
    """Counts SSE events and applies the stall/drop faults at the configured chunk."""

    def __init__(self, send: Send, faults: FaultSettings, batch: bool) -> None:
        self.send = send
        self.count = 0
        self.stall_at = faults.stall_after_chunks
        self.drop_at = faults.drop_after_chunks
        # At time_scale 0 everything is ready at once: one write instead of one per event.
        self.batch = batch and self.stall_at is None and self.drop_at is None
        self.pending: list[bytes] = []

    def _check(self) -> None:
        if self.drop_at is not None and self.count >= self.drop_at:
            raise _Dropped
        if self.stall_at is not None and self.count >= self.stall_at:
            raise _Stalled

    async def emit(self, event: bytes) -> None:
        self._check()
        self.count += 1
        if self.batch:
            self.pending.append(event)
        else:
            await self.send({"type": "http.response.body", "body": event, "more_body": True})

    async def close(self) -> None:
        self._check()
        self.pending.append(SSE_DONE)
        await self.send({"type": "http.response.body", "body": b"".join(self.pending), "more_body": False})


def _start(replica: Replica, reqs: list[EngineRequest]) -> None:
    """Hand requests to the engine.  At time_scale 0 they complete right here, so an engine
    error (KV cache too small) becomes the response's 503 before anything was sent."""
    try:
        replica.run(reqs)
    except EngineError as exc:
        raise APIError(503, str(exc)) from None


async def _stream(replica: Replica, job: _Job, receive: Receive, send: Send) -> None:
    engine = replica.engine
    faults = replica.faults.settings
    waiter = asyncio.Event()
    for r in job.reqs:
        r.waiter = waiter
        r.stream = True
    _start(replica, job.reqs)
    await start_stream(send)  # from here on errors go into the stream, not the status
    sink = _ChunkSink(send, faults, batch=engine.instant)
    gone = None if engine.instant and faults.stall_after_chunks is None else _watch(receive, waiter)
    try:
        await _emit_events(replica, job, sink, waiter, gone)
        await sink.close()
    except _Stalled:
        logger.warning("fault injection: stalling stream %s after %d chunks", job.rid, sink.count)
        if gone is not None:
            await asyncio.shield(gone)  # hold the connection until the client gives up
        _abort_all(replica, job)
    except _Dropped:
        logger.warning("fault injection: dropping the connection of %s after %d chunks", job.rid, sink.count)
        _abort_all(replica, job)
        # Returning without finishing the response makes uvicorn close the socket mid-stream.
    except _ClientLeft:
        _abort_all(replica, job)
    except Exception:  # headers are out: the best we can do is cut the stream and say why in the log
        logger.exception("stream %s failed", job.rid)
        _abort_all(replica, job)
    finally:
        if gone is not None:
            gone.cancel()


class _ClientLeft(Exception):
    pass


def _abort_all(replica: Replica, job: _Job) -> None:
    for r in job.reqs:
        replica.engine.abort(r)


async def _emit_events(
    replica: Replica, job: _Job, sink: _ChunkSink, waiter: asyncio.Event, gone: asyncio.Future[Any] | None
) -> None:
    reqs = job.reqs
    text = replica.textgen.text
    base: dict[str, Any] = {
        "id": job.rid,
        "object": "chat.completion.chunk" if job.chat else "text_completion",
        "created": job.created,
        "model": job.model,
    }
    include_usage, continuous = job.stream_usage
    make: Callable[[int, str, str | None], dict[str, Any]]
    # Like vLLM, the role chunks go out with the engine's first output (after the prefill),
    # not when the request arrives: the first byte of a chat stream marks the first token.
    roles_pending = job.chat
    if job.chat:

        def make(index: int, piece: str, finish: str | None) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": index, "delta": {"content": piece}, "logprobs": None}
            choice["finish_reason"] = finish
            if finish is not None:
                choice["stop_reason"] = None
            choice["token_ids"] = None
            return choice

    else:

        def make(index: int, piece: str, finish: str | None) -> dict[str, Any]:
            return {
                "index": index,
                "text": piece,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
                "prompt_token_ids": None,
                "token_ids": None,
            }

    sent = [0] * len(reqs)
    generated = 0
    while True:
        if roles_pending and any(r.num_output or r.finished for r in reqs if r.error is None):
            roles_pending = False
            for index in range(len(reqs)):
                delta = {"role": "assistant", "content": ""}
                role = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
                await sink.emit(sse({**base, "choices": [role], "prompt_token_ids": None, "prompt_text": None}))
        for index, r in enumerate(reqs):
            if r.error is not None:
                err = APIError(503, r.error)
                await sink.emit(b"data: " + err.body() + b"\n\n")
                return
            while sent[index] < r.num_output:
                k = sent[index]
                piece = text[r.output[k]]
                if k == 0 and job.echo is not None:
                    piece = job.echo[index // job.n] + piece
                last = k + 1 == r.max_tokens
                payload = {**base, "choices": [make(index, piece, r.stop_reason if last else None)]}
                sent[index] = k + 1
                generated += 1
                if continuous:
                    payload["usage"] = _usage(replica, job, generated, stream=True)
                await sink.emit(sse(payload))
        if all(r.finished for r in reqs):
            break
        if gone is None:  # pragma: no cover - instant mode finishes before streaming starts
            break
        await waiter.wait()
        waiter.clear()
        if gone.done():
            raise _ClientLeft
    if include_usage:
        usage_chunk = {**base, "choices": [], "usage": _usage(replica, job, stream=True)}
        usage_chunk["system_fingerprint"] = replica.fingerprint
        await sink.emit(sse(usage_chunk))
