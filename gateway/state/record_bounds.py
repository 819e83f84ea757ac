"""The most keys one affinity record can hold: what a ``max_body_bytes`` prompt can produce.

A peer's record is a list of stored block keys (:meth:`AffinityIndex.stored_keys` of one
prompt's chain).  No prompt this gateway accepts makes more than the bound below, so a peer
record above it is not from a prompt: it is refused (``oversize``), and a local one above it
is kept local.  Derived, not guessed, from the route's settings and the body limit ``B``:

- token blocks: at most ``window_tokens // block_size``;
- past the window, a token-id prompt (``[1,1,...]``, 2 bytes an id) gets one key per
  ``_ID_CHUNK`` (256) ids: at most ``B / 512 + 1``;
- text (:func:`gateway.prefix.blocks.chain_text_keys`) gets, per message, one key per
  ``chunk_bytes`` of its hashed bytes, and every message ends its own chunk: at most
  ``M + D / chunk_bytes`` keys for ``M`` messages of ``D`` hashed bytes in all.  A message
  costs at least 3 body bytes (``{},``), so ``M <= B / 3 + 1`` (the tool definitions are one
  more).  A body byte becomes at most 4.5 hashed bytes (the tool definitions are re-serialized:
  ``1e15`` is 4 bytes in, ``1000000000000000.0`` 18 out; content parts read at most 2 out for
  1 in) and each message adds a 2-byte mark: ``D <= 4.5 B + 2 M``;
- ``normalize.mode: relocate`` replaces each moved span (at least a character of the scanned
  text: ``max_scan_chars``, ``completion_prefix_chars``) by a placeholder of at most 52
  characters (a rule name is at most 32) and appends it again with its value to a block: at
  most ``108`` more bytes a scanned character, plus the block's frame and one more message;
- the index stores every ``stride``-th key and the deepest: ``ceil(K / stride) + 1``.

With the defaults (10 MiB, 4,096-token window, 16-token blocks, 1 KiB chunks) the message
term dominates (a body of empty messages): the bound is above the wire's own
``MAX_KEYS_PER_RECORD`` (65,536), which then applies.  A smaller ``max_body_bytes`` lowers it
(64 KiB: about 22,000 keys at stride 1).
"""

from __future__ import annotations

import math

from gateway.prefix.blocks import MESSAGE_MARK
from gateway.state.wire import MAX_KEYS_PER_RECORD

_ID_CHUNK = 256  # gateway.prefix.pipeline._ID_CHUNK: token ids per continuation key
_MIN_MESSAGE_BYTES = 3  # "{},"
_MAX_EXPANSION = 4.5  # hashed bytes per body byte, at most (see the module docstring)
_MARK_BYTES = len(MESSAGE_MARK)
# "{{volatile:" + a 32-character rule name + ":" + up to 6 digits + "}}" = 52, in place and in
# the block, plus " = " and a newline
_RELOCATED_BYTES_PER_CHAR = 2 * 52 + 4
_BLOCK_FRAME_BYTES = 128  # "\n\n<volatile_values check=...>\n" ... "</volatile_values>"


def relocated_bytes(mode: str, scanned_chars: int) -> int:
    """The most bytes relocation can add to a prompt whose first ``scanned_chars`` are scanned."""
    return _RELOCATED_BYTES_PER_CHAR * scanned_chars + _BLOCK_FRAME_BYTES if mode == "relocate" else 0


def max_chain_keys(body_bytes: int, window_tokens: int, block_size: int, chunk_bytes: int, relocated: int = 0) -> int:
    """The most keys (token blocks and continuation) one prompt of ``body_bytes`` can produce,
    ``relocated`` (:func:`relocated_bytes`) the most bytes its normalization adds."""
    blocks = window_tokens // max(1, block_size)
    messages = body_bytes // _MIN_MESSAGE_BYTES + 1 + (1 if relocated else 0)
    hashed = _MAX_EXPANSION * body_bytes + _MARK_BYTES * messages + relocated
    text = messages + math.ceil(hashed / max(1, chunk_bytes))
    ids = body_bytes // (2 * _ID_CHUNK) + 1
    return blocks + max(text, ids)


def max_record_keys(
    body_bytes: int, window_tokens: int, block_size: int, chunk_bytes: int, stride: int, relocated: int = 0
) -> int:
    """The most stored keys one record of such a prompt holds, never above ``MAX_KEYS_PER_RECORD``."""
    chain = max_chain_keys(body_bytes, window_tokens, block_size, chunk_bytes, relocated)
    return min(MAX_KEYS_PER_RECORD, math.ceil(chain / max(1, stride)) + 1)
