"""Usage sniffing and the stream relay.

Non-streaming: the usage object sits at the end of the response; we decode just that
object instead of the whole (possibly large, e.g. embeddings) body.

Streaming: bytes go to the client as they arrive.  When the gateway itself added
``stream_options.include_usage`` (the client did not ask), the relay works per SSE event so
it can drop the extra usage-only chunk and the ``"usage":null`` fields the option adds —
the client then receives exactly what the replica would have sent it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

_DECODER = json.JSONDecoder()
_USAGE_NULLS = (b',"usage":null', b', "usage": null', b'"usage":null,', b'"usage": null, ')


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None  # None: the replica did not report it ("unknown", not 0)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def usage_from_obj(usage: Any) -> Usage | None:
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else None
    return Usage(_int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens")), cached)


def sniff_json_usage(body: bytes) -> Usage | None:
    """The last top-level-looking ``"usage": {...}`` object of a JSON response."""
    at = body.rfind(b'"usage"')
    if at < 0:
        return None
    try:
        text = body[at:].decode("utf-8")
        colon = text.index(":") + 1
        while colon < len(text) and text[colon] in " \t\r\n":
            colon += 1
        obj, _ = _DECODER.raw_decode(text, colon)
    except ValueError:
        return None
    return usage_from_obj(obj)


def _event_payload(event: bytes) -> Any:
    for line in event.splitlines():
        if line.startswith(b"data:"):
            data = line[5:].strip()
            if data and data != b"[DONE]":
                try:
                    return json.loads(data)
                except ValueError:
                    return None
    return None


def _detect_separator(buffer: bytes) -> bytes | None:
    """The event separator, from the first complete one in ``buffer`` (None: none yet).

    A CRLF stream never contains ``\n\n`` and an LF stream never ``\r\n\r\n``, so the first
    one present decides — never a guess from a chunk that may end between ``\r`` and ``\n``.
    """
    if b"\r\n\r\n" in buffer:
        return b"\r\n\r\n"
    if b"\n\n" in buffer:
        return b"\n\n"
    return None


class StreamRelay:
    """Feeds upstream bytes through; records usage; optionally strips gateway-added usage.

    Events are framed with ``bytes.rfind``/``split`` on the blank-line separator (``\n\n``,
    or ``\r\n\r\n`` when the stream uses CRLF) — C-speed, a few microseconds per chunk.
    Pass-through mode returns every byte immediately and only keeps the unfinished tail
    event aside to find the usage object; strip mode holds an unfinished event until its end
    arrives (the client could not use half an event anyway).
    """

    __slots__ = ("_pending", "_sep", "ended", "strip", "usage")

    def __init__(self, strip_usage: bool) -> None:
        self.strip = strip_usage
        self.usage: Usage | None = None
        self.ended = False  # the stream's ``data: [DONE]`` went through: the client has the whole answer
        self._pending = b""
        self._sep: bytes | None = None

    def _complete_events(self, data: bytes) -> bytes:
        """Append ``data``; return the complete events (through the last separator), keep the rest."""
        buffer = self._pending + data if self._pending else data
        sep = self._sep
        if sep is None:
            sep = self._sep = _detect_separator(buffer)
            if sep is None:  # no complete event yet: decide when one is (a chunk may end mid-"\r\n")
                self._pending = buffer
                return b""
        cut = buffer.rfind(sep)
        if cut < 0:
            self._pending = buffer
            return b""
        cut += len(sep)
        self._pending = buffer[cut:]
        return buffer[:cut]

    def feed(self, data: bytes) -> bytes:
        """Bytes to send to the client now."""
        complete = self._complete_events(data)
        if complete and b"[DONE]" in complete and self._ends(complete):
            self.ended = True
        if not self.strip:
            if complete and b'"usage"' in complete:
                self._sniff(complete)
            return data
        if not complete or b'"usage"' not in complete:
            return complete
        sep = self._sep or b"\n\n"
        events = complete.split(sep)  # the last element is b"" (complete ends with sep)
        out: list[bytes] = []
        for event in events[:-1]:
            if b'"usage"' in event:
                stripped = self._strip_event(event)
                if stripped is None:
                    continue
                event = stripped
            out.append(event)
            out.append(sep)
        return b"".join(out)

    def _ends(self, complete: bytes) -> bool:
        """``complete`` holds the terminating event itself (not ``[DONE]`` inside a content string)."""
        sep = self._sep or b"\n\n"
        return any(event.strip() == b"data: [DONE]" for event in complete.split(sep))

    def finish(self) -> bytes:
        """Whatever is left at the end of the stream (an unterminated last event)."""
        rest, self._pending = self._pending, b""
        if not self.strip:
            if rest and b'"usage"' in rest:
                self._sniff(rest)
            return b""
        return rest

    def _sniff(self, complete: bytes) -> None:
        for event in complete.split(self._sep or b"\n\n"):
            if b'"usage"' in event:
                obj = _event_payload(event)
                if isinstance(obj, dict):
                    usage = usage_from_obj(obj.get("usage"))
                    if usage is not None:
                        self.usage = usage

    def _strip_event(self, event: bytes) -> bytes | None:
        obj = _event_payload(event)
        if not isinstance(obj, dict) or "usage" not in obj:
            return event
        usage = obj.get("usage")
        if usage is None:
            for pattern in _USAGE_NULLS:
                if pattern in event:
                    return event.replace(pattern, b"", 1)
            return event
        parsed = usage_from_obj(usage)
        if parsed is not None:
            self.usage = parsed
        if obj.get("choices") == []:
            return None  # the usage-only chunk the gateway asked for
        return event
