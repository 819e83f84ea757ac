"""Hand-made ext_proc messages, as Envoy sends them, for driving ``PickerStream`` without Envoy."""

from __future__ import annotations

import json
from typing import Any

from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, Metadata
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf.struct_pb2 import Struct

from gateway.epp import messages as m


def _headers(pairs: dict[str, str]) -> HeaderMap:
    return HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()])


def _metadata(namespace: str, key: str, value: Any) -> Metadata:
    space = Struct()
    space.update({key: value})
    return Metadata(filter_metadata={namespace: space})


def request_headers(
    path: str = "/v1/chat/completions",
    method: str = "POST",
    end: bool = False,
    subset: list[str] | None = None,
    **extra: str,
) -> ep.ProcessingRequest:
    pairs = {":method": method, ":path": path, ":authority": "gw", "content-type": "application/json", **extra}
    message = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=_headers(pairs), end_of_stream=end))
    if subset is not None:
        message.metadata_context.CopyFrom(_metadata(m.SUBSET_NAMESPACE, m.SUBSET, subset))
    return message


def request_body(data: bytes | dict[str, Any], end: bool = True) -> ep.ProcessingRequest:
    raw = data if isinstance(data, bytes) else json.dumps(data).encode()
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=raw, end_of_stream=end))


def response_headers(
    status: int = 200, content_type: str = "application/json", served: str | None = None, *, in_metadata: bool = False
) -> ep.ProcessingRequest:
    pairs = {":status": str(status), "content-type": content_type}
    if served is not None and not in_metadata:
        pairs[m.SERVED] = served
    message = ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=_headers(pairs)))
    if served is not None and in_metadata:
        message.metadata_context.CopyFrom(_metadata(m.LB_NAMESPACE, m.SERVED, served))
    return message


def response_body(data: bytes | dict[str, Any], end: bool = True) -> ep.ProcessingRequest:
    raw = data if isinstance(data, bytes) else json.dumps(data).encode()
    return ep.ProcessingRequest(response_body=ep.HttpBody(body=raw, end_of_stream=end))


def chat(content: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": "demo-model", "messages": [{"role": "user", "content": content}], **extra}


def completion_reply(prompt_tokens: int = 40, cached: int | None = 32) -> dict[str, Any]:
    details = {"cached_tokens": cached} if cached is not None else None
    return {
        "id": "x",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 2,
            "total_tokens": prompt_tokens + 2,
            "prompt_tokens_details": details,
        },
    }


def picked(responses: list[ep.ProcessingResponse]) -> tuple[str, str]:
    """(header value, envoy.lb metadata value) of the pick among ``responses``."""
    for response in responses:
        if response.WhichOneof("response") == "request_headers":
            header = next(
                h.header.raw_value.decode()
                for h in response.request_headers.response.header_mutation.set_headers
                if h.header.key == m.DESTINATION
            )
            meta = response.dynamic_metadata.fields[m.LB_NAMESPACE].struct_value.fields[m.DESTINATION].string_value
            return header, meta
    raise AssertionError(f"no pick in {[r.WhichOneof('response') for r in responses]}")


def body_out(responses: list[ep.ProcessingResponse], part: str = "request_body") -> tuple[bytes, bool, list[int]]:
    """The streamed body the responses carry: (bytes, last chunk's end_of_stream, chunk sizes)."""
    chunks = [
        getattr(r, part).response.body_mutation.streamed_response for r in responses if r.WhichOneof("response") == part
    ]
    return b"".join(c.body for c in chunks), bool(chunks) and chunks[-1].end_of_stream, [len(c.body) for c in chunks]


def immediate(responses: list[ep.ProcessingResponse]) -> tuple[int, dict[str, Any]]:
    assert len(responses) == 1 and responses[0].WhichOneof("response") == "immediate_response", responses
    reply = responses[0].immediate_response
    return reply.status.code, json.loads(reply.body)
