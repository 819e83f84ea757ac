"""Builders of the ``ProcessingResponse`` messages the picker sends Envoy, and readers of what
Envoy sends: one place that knows the ext_proc protobuf shapes.

Protocol: kubernetes-sigs/gateway-api-inference-extension, docs/proposals/004-endpoint-picker-protocol
(v1).  The pick travels twice, identical: the ``x-gateway-destination-endpoint`` header and the
``envoy.lb`` dynamic metadata entry of the same name (a proxy may read either).  Bodies are sent
back as streamed body mutations (``FULL_DUPLEX_STREAMED``), in chunks under Envoy's 64 KiB.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, HeaderValueOption
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.struct_pb2 import Struct

from gateway.errors import GatewayError

#: the protocol's names (v1)
DESTINATION = "x-gateway-destination-endpoint"
SUBSET = "x-gateway-destination-endpoint-subset"
SERVED = "x-gateway-destination-endpoint-served"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"

#: one streamed body chunk at most: Envoy takes up to 64 KiB per message; GIE keeps a margin too
BODY_CHUNK_BYTES = 62_000

_OVERWRITE = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def set_header(key: str, value: bytes) -> HeaderValueOption:
    return HeaderValueOption(header=HeaderValue(key=key, raw_value=value), append_action=_OVERWRITE)


def pick_headers(
    endpoints: str,
    content_length: int | None,
    extra: Iterable[tuple[str, bytes]] = (),
    remove: Iterable[str] = (),
) -> ep.ProcessingResponse:
    """The request headers' answer: the pick as a header and as ``envoy.lb`` metadata.

    ``content_length``: the (possibly rewritten) body's length, so the header the replica sees
    matches the bytes it gets; ``extra``: more headers to set (the replica's Authorization);
    ``remove``: headers the replica must not get (the client's Authorization).
    """
    value = endpoints.encode()
    mutation = ep.HeaderMutation(
        set_headers=[set_header(DESTINATION, value), *(set_header(k, v) for k, v in extra)],
        remove_headers=list(remove),
    )
    if content_length is not None:
        mutation.set_headers.append(set_header("content-length", str(content_length).encode()))
    metadata = Struct()
    metadata.get_or_create_struct(LB_NAMESPACE)[DESTINATION] = endpoints
    return ep.ProcessingResponse(
        request_headers=ep.HeadersResponse(response=ep.CommonResponse(header_mutation=mutation)),
        dynamic_metadata=metadata,
    )


def continue_request_headers() -> ep.ProcessingResponse:
    """Request headers passed on untouched (a path the picker does not route: Envoy's fallback LB picks)."""
    return ep.ProcessingResponse(request_headers=ep.HeadersResponse())


def response_headers(remove: Iterable[str] = ()) -> ep.ProcessingResponse:
    """The response headers' answer; ``remove``: headers the client must not see (the served endpoint)."""
    mutation = ep.HeaderMutation(remove_headers=list(remove))
    return ep.ProcessingResponse(
        response_headers=ep.HeadersResponse(response=ep.CommonResponse(header_mutation=mutation))
    )


def request_trailers() -> ep.ProcessingResponse:
    return ep.ProcessingResponse(request_trailers=ep.TrailersResponse())


def response_trailers() -> ep.ProcessingResponse:
    return ep.ProcessingResponse(response_trailers=ep.TrailersResponse())


def _chunks(data: bytes, end: bool) -> Iterator[tuple[bytes, bool]]:
    if len(data) <= BODY_CHUNK_BYTES:
        yield data, end
        return
    view = memoryview(data)
    for at in range(0, len(data), BODY_CHUNK_BYTES):
        piece = bytes(view[at : at + BODY_CHUNK_BYTES])
        yield piece, end and at + BODY_CHUNK_BYTES >= len(data)


def _body(part: str, data: bytes, end: bool) -> list[ep.ProcessingResponse]:
    out = []
    for piece, eos in _chunks(data, end):
        mutation = ep.BodyMutation(streamed_response=ep.StreamedBodyResponse(body=piece, end_of_stream=eos))
        out.append(ep.ProcessingResponse(**{part: ep.BodyResponse(response=ep.CommonResponse(body_mutation=mutation))}))
    return out


def request_body(data: bytes, end: bool) -> list[ep.ProcessingResponse]:
    """``data`` as the request body's streamed mutation(s), each under :data:`BODY_CHUNK_BYTES`."""
    return _body("request_body", data, end)


def response_body(data: bytes, end: bool) -> list[ep.ProcessingResponse]:
    """``data`` as the response body's streamed mutation(s) (the replica's bytes, relayed)."""
    return _body("response_body", data, end)


def immediate(status: int, body: bytes, headers: Iterable[tuple[bytes, bytes]] = ()) -> ep.ProcessingResponse:
    """Envoy answers the client with this and ends the request (nothing reaches a replica)."""
    mutation = ep.HeaderMutation(
        set_headers=[set_header("content-type", b"application/json")]
        + [set_header(k.decode("latin-1"), v) for k, v in headers]
    )
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(status=HttpStatus(code=status), headers=mutation, body=body)
    )


def immediate_error(exc: GatewayError) -> ep.ProcessingResponse:
    """A gateway error in OpenAI's shape (``{"error": {...}}``), with its headers (retry-after on 429/503)."""
    return immediate(exc.status, exc.to_bytes(), getattr(exc, "headers", ()))


def header_map(headers: HeaderMap) -> dict[str, str]:
    """Envoy's header map as ``{lower-case name: value}`` (Envoy sends ``raw_value`` bytes)."""
    out: dict[str, str] = {}
    for h in headers.headers:
        out[h.key] = h.raw_value.decode("latin-1") if h.raw_value else h.value
    return out


def metadata_strings(request: ep.ProcessingRequest, namespace: str, key: str) -> list[str] | None:
    """``metadata_context.filter_metadata[namespace][key]`` as strings (a list, or one
    comma-separated string); None when absent."""
    if not request.HasField("metadata_context"):
        return None
    space = request.metadata_context.filter_metadata.get(namespace)
    if space is None or key not in space.fields:
        return None
    value = space.fields[key]
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return split_endpoints(value.string_value)
    if kind == "list_value":
        return [v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value"]
    return []


def split_endpoints(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]
