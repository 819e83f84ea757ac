"""Read and check a request body: only what routing needs, everything else passes through.

Full pydantic models of OpenAI bodies would cost more than the rest of the hot path and
would reject vLLM's extra sampling parameters; we check the handful of fields the gateway
reads (and the commonest wrong types), and forward the client's bytes untouched.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from gateway.errors import BadRequest, ClientDisconnected, PayloadTooLarge


async def read_body(
    receive: Any, limit: int, content_length: str | None, reserve: Callable[[int], None] | None = None
) -> bytes:
    """The whole request body, or 413 as soon as it is known to exceed ``limit``.

    ``reserve(total)`` is told how many bytes the body will hold before they are kept — the
    declared ``Content-Length`` before reading, a chunked body's size as it grows — and
    raises to refuse (``gateway.http.capacity``: the process-wide body-bytes cap).
    """
    if content_length is not None:
        try:
            declared = int(content_length)
        except ValueError:
            raise BadRequest("invalid Content-Length header") from None
        if declared > limit:
            raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {limit} bytes")
        if reserve is not None and declared > 0:
            reserve(declared)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected()
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
            if reserve is not None:
                reserve(size)  # a no-op while within the declared length
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def as_utf8(raw: bytes) -> bytes:
    """The body as UTF-8 JSON bytes, whatever Unicode encoding ``json.loads`` would accept.

    ``json.loads`` reads UTF-16 and UTF-32 bodies (and a UTF-8 BOM) by their first bytes
    (``json.detect_encoding``), and so does vLLM's server; the gateway's raw-byte edits of
    the client's body (the ``include_usage`` splice in ``gateway.proxy.handler``) and
    everything that keeps it (warm restarts) work on UTF-8 bytes.  Transcoding here, once,
    makes both agree without turning away bodies a replica would have taken; UTF-8 bodies —
    all but a rare few — are returned as they are (no copy).  Undecodable bytes → 400.
    """
    encoding = json.detect_encoding(raw)
    if encoding == "utf-8":
        return raw
    if encoding == "utf-8-sig":
        return raw[3:]
    try:
        text = raw.decode(encoding, "surrogatepass")  # as json.loads decodes
    except UnicodeDecodeError as exc:
        raise BadRequest(
            f"request body is not valid {encoding.upper()} JSON: {exc.reason}", code="invalid_json"
        ) from None
    # a lone surrogate (legal in a JSON string, not encodable) becomes its JSON escape, \udXXX
    return text.removeprefix("\ufeff").encode("utf-8", "backslashreplace")


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def _is_prompt(value: Any) -> bool:
    """str | list[str] | list[int] | list[list[int]] (OpenAI's prompt / input shapes)."""
    if isinstance(value, str):
        return True
    if not isinstance(value, list) or not value:
        return False
    first = value[0]
    if isinstance(first, str):
        return all(isinstance(v, str) for v in value)
    if isinstance(first, int):
        return _is_int_list(value)
    if isinstance(first, list):
        return all(_is_int_list(v) for v in value)
    return False


_NUMBER_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty")
_INT_FIELDS = ("max_tokens", "max_completion_tokens", "n")


def _type_error(field: str, expected: str) -> BadRequest:
    return BadRequest(f"'{field}' must be {expected}", param=field, code="invalid_type")


#: deepest JSON nesting accepted.  Real OpenAI bodies (tool schemas, multimodal content)
#: stay far below; anything deeper only exists to crash recursive code downstream
#: (``json`` itself raises ``RecursionError`` near 1,000 levels, and the normalizer, the
#: chat template and ``json.dumps`` all recurse).
MAX_JSON_DEPTH = 128


def _too_deep(raw: bytes, value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``value`` nests containers deeper than ``limit``.

    Counting brackets in the raw bytes (C speed) settles almost every request: fewer
    brackets than ``limit`` cannot nest that deep.  Only bodies with many brackets get the
    iterative walk (no recursion: the point is to survive hostile depth).
    """
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        for child in children:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return False


def _too_deep_error() -> BadRequest:
    return BadRequest(f"request body is nested too deeply (more than {MAX_JSON_DEPTH} levels)", code="invalid_json")


def parse_body(raw: bytes, endpoint: str) -> dict[str, Any]:
    """Parse JSON and check the fields routing reads.  Raises :class:`BadRequest` (400)."""
    if not raw:
        raise BadRequest("request body is empty; expected a JSON object", code="invalid_json")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise _too_deep_error() from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_json")
    if _too_deep(raw, body):
        raise _too_deep_error()
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise (
            _type_error("model", "a non-empty string")
            if "model" in body
            else BadRequest("'model' is required", param="model", code="missing_required_parameter")
        )
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _type_error("stream", "a boolean")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _type_error("stream_options", "an object")
    if endpoint == "chat":
        messages = body.get("messages")
        if messages is None:
            raise BadRequest("'messages' is required", param="messages", code="missing_required_parameter")
        if not isinstance(messages, list) or not messages:
            raise _type_error("messages", "a non-empty array of message objects")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise _type_error(f"messages[{i}]", "an object with a string 'role'")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise _type_error("tools", "an array")
    elif endpoint == "completions":
        if "prompt" not in body:
            raise BadRequest("'prompt' is required", param="prompt", code="missing_required_parameter")
        if not _is_prompt(body["prompt"]):
            raise _type_error("prompt", "a string, an array of strings, or an array of token ids")
    elif endpoint == "embeddings":
        if "input" not in body:
            raise BadRequest("'input' is required", param="input", code="missing_required_parameter")
        if not _is_prompt(body["input"]):
            raise _type_error("input", "a string, an array of strings, or an array of token ids")
    for field in _NUMBER_FIELDS:
        value = body.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise _type_error(field, "a number")
    for field in _INT_FIELDS:
        value = body.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise _type_error(field, "an integer")
    return body
