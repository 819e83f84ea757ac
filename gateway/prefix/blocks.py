"""Chained block hashes over token ids, the way vLLM keys its prefix cache.

vLLM splits a prompt into fixed-size token blocks and hashes each *full* block together
with its parent block's hash, so block *i*'s key identifies the whole prefix
``tokens[: (i + 1) * block_size]``.  Extra keys (model/LoRA name, ``cache_salt``) go into
the first block, so different models and salted tenants never share a key.

Both the simulator's KV cache and the gateway's router use this one function, so they
agree on what "the same prefix" means.  Keys are xxh3-64 integers: stable across
processes and machines (no Python ``hash()`` randomization).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import xxhash

# The parent of the first block: a fixed, arbitrary constant (vLLM uses a seed too).
ROOT_KEY = 0x9E3779B97F4A7C15


def first_block_seed(model: str, lora: str | None = None, cache_salt: str | None = None) -> int:
    """Seed for block 0 from the extra keys; ``None`` and ``""`` are the same (no salt/LoRA).

    ``surrogatepass``: the names come from client JSON, where ``"\\ud800"`` is a valid escape
    for a lone surrogate that plain UTF-8 cannot encode.  Valid text encodes exactly as
    before (keys are unchanged); a lone surrogate gets its own distinct bytes instead of
    raising.
    """
    extra = f"{model}\x00{lora or ''}\x00{cache_salt or ''}".encode("utf-8", "surrogatepass")
    return xxhash.xxh3_64_intdigest(extra, seed=ROOT_KEY & 0xFFFFFFFFFFFFFFFF)


def engine_seed(base_model: str, lora: str | None, cache_salt: str | None) -> int:
    """The first block's seed for a request (or a KV event) the way the engine isolates caches.

    vLLM keys its blocks by LoRA adapter and ``cache_salt`` (its extra keys), never by the
    served-model alias a client named.  So the identity is the replica's *base* served model
    (the ``/v1/models`` entry without a ``parent``), the adapter name when the request's model
    is a LoRA adapter of it (an entry whose ``parent`` is the base), and the request's salt.
    The request side (:mod:`gateway.prefix.pipeline`) and the KV-event side both call this,
    so a stored block and a request for the same prefix get the same key.
    """
    return first_block_seed(base_model, lora, cache_salt)


def chain_block_keys(
    tokens: Sequence[int],
    block_size: int,
    seed: int,
    max_blocks: int | None = None,
) -> list[int]:
    """Keys of each *full* block of ``tokens`` (a partial tail block gets no key).

    ``seed`` comes from :func:`first_block_seed`.  ``max_blocks`` bounds the work.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    full = len(tokens) // block_size
    if max_blocks is not None:
        full = min(full, max_blocks)
    if full == 0:
        return []
    packed = array("I", tokens[: full * block_size]).tobytes()
    stride = block_size * 4
    keys: list[int] = []
    parent = seed
    hasher = xxhash.xxh3_64_intdigest
    for i in range(full):
        parent = hasher(packed[i * stride : (i + 1) * stride], seed=parent)
        keys.append(parent)
    return keys


# A continuation key's separator between messages: bytes that never start a UTF-8 character,
# so a message boundary can never hash like text inside a message.
MESSAGE_MARK = b"\xff\xfe"


class TextChain(NamedTuple):
    """What :func:`chain_text_keys` returns (see there)."""

    keys: list[int]
    ends: list[int]  # per key: bytes of text up to its chunk's end
    prints: list[bytes]  # per key: its chunk's piece prints (b"" for none)
    first_start: int  # bytes of text before the first key's chunk


@dataclass(frozen=True, slots=True)
class TextForks:
    """Where inside a text chunk a prompt parts from one held before: what a request carries
    for it (see :func:`chain_text_keys`'s prints), one entry per text key."""

    prints: tuple[bytes, ...]  # per text key: its chunk's piece prints
    ends: tuple[int, ...]  # per text key: bytes of text up to its chunk's end
    piece_bytes: int  # bytes per print piece
    first_start: tuple[int, int]  # where the first text key's chunk starts: (bytes, tokens estimated)

    def tokens_at(self, index: int, pieces: float, key_tokens: Sequence[int]) -> int:
        """Prompt tokens up to ``pieces`` pieces into text key ``index``'s chunk: interpolated
        by bytes between the chunk's two ends (``key_tokens``, the estimates the keys carry)."""
        start_bytes, start = (self.ends[index - 1], key_tokens[index - 1]) if index else self.first_start
        end_bytes, end = self.ends[index], key_tokens[index]
        size = end_bytes - start_bytes
        if size <= 0:
            return start
        return start + int((end - start) * min(size, pieces * self.piece_bytes) / size)


def chain_text_keys(
    messages: Iterable[Sequence[str]],
    parent: int,
    chunk_bytes: int,
    skip_bytes: int = 0,
    print_bytes: int = 0,
    print_tail: int = 0,
) -> TextChain:
    """Continue a key chain over text, message by message, in chunks of ``chunk_bytes``.

    Token blocks stop at the window (tokenizing is what costs); past it, prompts still differ
    and must get different keys.  Each message (a sequence of text pieces: its role, its
    content, its tool calls) is UTF-8 encoded once and cut into chunks of at most
    ``chunk_bytes`` bytes; a message's last chunk ends at its own end.  So appending a
    message never changes the keys of the content before it, and a conversation's next turn
    contains every key of the last.  Each key hashes its chunk with the previous key as seed
    (``parent`` first: the last token block's key), so key *j* names everything up to its
    end, like a token block's key.

    The chain runs over the whole text (no gap, whatever the bytes per token), but keys whose
    chunk ends within the first ``skip_bytes`` bytes are not returned: that text lies inside
    the token window, which already tells prompts apart there.

    With ``print_bytes`` (a divisor of ``chunk_bytes``), each returned chunk also gets its
    *prints*: the xxh32 of each ``print_bytes`` piece of it but the last, packed as uint32.
    Two chunks that follow the same key agree on their first *j* pieces exactly when their
    first *j* prints agree, so where two prompts part inside a chunk the prints tell how far
    into it they still share text (:meth:`gateway.kv_events.text_tail.TextTail.fork`).
    They cost one xxh32 call per piece (~0.2 µs), so the pipeline asks for them only where a
    precise replica can use them, and with ``print_tail`` only for the chunks that end in the
    text's last ``print_tail`` bytes (where a conversation's next turn, a tool loop's next
    step or another question on the same document part from it); the others get ``b""``.

    Returns the keys, for each the bytes of text up to its end (for a token estimate) and its
    prints (``b""`` each without ``print_bytes``), and where the first key's chunk starts.
    Never recurses, never raises on odd text (lone surrogates are hashed as is).  Cost: one
    encode per message and one xxh3 call per chunk over a memoryview (no copies).
    """
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    if print_bytes < 0 or (print_bytes and chunk_bytes % print_bytes):
        raise ValueError("print_bytes must divide chunk_bytes")
    hasher = xxhash.xxh3_64_intdigest
    printer = xxhash.xxh32_intdigest
    keys: list[int] = []
    ends: list[int] = []
    spans: list[tuple[memoryview, int, int]] = []  # per key: its message's bytes and the chunk in them
    first_start = 0
    offset = 0
    for pieces in messages:
        data = memoryview(MESSAGE_MARK + "\x1f".join(pieces).encode("utf-8", "surrogatepass"))
        n = len(data)
        start = 0
        while start < n:
            stop = start + chunk_bytes
            parent = hasher(data[start:stop], seed=parent)
            end = offset + min(stop, n)
            if end > skip_bytes:
                if not keys:
                    first_start = offset + start
                keys.append(parent)
                ends.append(end)
                if print_bytes:
                    spans.append((data, start, min(stop, n)))
            start = stop
        offset += n
    prints = [b""] * len(keys)
    if print_bytes:
        since = offset - print_tail if print_tail > 0 else 0
        for i in range(len(keys) - 1, -1, -1):
            if ends[i] <= since:
                break
            data, start, stop = spans[i]
            # the last piece is the key's own business: it agrees only where the whole chunk does
            marks = [printer(data[o : o + print_bytes]) for o in range(start, stop - print_bytes, print_bytes)]
            if marks:
                prints[i] = array("I", marks).tobytes()
    return TextChain(keys, ends, prints, first_start)


def chain_id_keys(ids: Sequence[int], parent: int, chunk_tokens: int) -> list[int]:
    """Continue a key chain over token ids past the window, ``chunk_tokens`` ids per key.

    For completion prompts given as token ids: cheaper than one key per block, and exact
    (the partial last chunk gets a key too).  Ids outside u32 are folded, never an error.
    """
    if chunk_tokens <= 0:
        raise ValueError("chunk_tokens must be positive")
    hasher = xxhash.xxh3_64_intdigest
    keys: list[int] = []
    for start in range(0, len(ids), chunk_tokens):
        chunk = ids[start : start + chunk_tokens]
        try:
            data = array("I", chunk).tobytes()
        except (OverflowError, TypeError):
            data = repr(list(chunk)).encode()
        parent = hasher(data, seed=parent)
        keys.append(parent)
    return keys
