"""HMAC envelopes for the messages gateway processes exchange through Redis pub/sub.

Anyone who can publish on the Redis channels — any client of that Redis — could otherwise
forge load reports (steering traffic away from a replica) or affinity records (pulling a
prefix onto one replica).  With a shared secret (``state.secret_env``, default
``PREFIX_GATEWAY_STATE_SECRET``) every message is sent as::

    h2:<sender>:<sequence>:<unix time, ms>:<hex HMAC-SHA256(secret, "<sender>:<sequence>:<time>:" + payload)>:<payload>

``sender`` is a random boot id drawn when the process starts (16 hex digits) and
``sequence`` counts that sender's messages from 1.  A receiver drops (and counts) anything
unsigned, badly signed, older/newer than ``MAX_SKEW_S``, or *replayed*: a sequence it has
already accepted from that sender, one more than ``REPLAY_WINDOW`` behind the sender's
newest, or a message sealed before the receiver itself started (it cannot know what it
missed, and pub/sub only delivers what is published after subscribing).  Without the
sequence, a recorded message could be published again within its 30 s and be accepted, e.g.
to keep a dead pod's load report alive.  A sender that restarts draws a new boot id, so its
first messages are a new sender's and are accepted.  Messages of one sender go out on two
channels over pooled connections and may arrive out of order: the window (like IPsec's
anti-replay window) accepts a late sequence once.

Memory: per sender heard within the last ``2 * MAX_SKEW_S``, its newest sequence and a
``REPLAY_WINDOW``-bit mask (about 300 bytes); at most ``MAX_SENDERS`` (only holders of the
secret can add one).  A sender silent longer is forgotten: any replay of its messages is
older than ``MAX_SKEW_S`` by then and refused for its age.

``derive_key`` gives other uses of the secret their own key (e.g. the keyed value digests
of :mod:`gateway.prefix.learn`), so no two uses share one.  The payload itself is the
unchanged JSON wire format of :mod:`gateway.state.wire`.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from typing import Literal

PREFIX = b"h2:"
MAX_SKEW_S = 30.0  # pods' clocks (NTP) agree far better; replays within it are refused by sequence
REPLAY_WINDOW = 1024  # how far out of order one sender's messages may arrive and still be accepted
_WINDOW_MASK = (1 << REPLAY_WINDOW) - 1
MAX_SENDERS = 4096
START_SLACK_S = 1.0  # a message sealed this long before the receiver started is still taken (clock skew)

Verdict = Literal["ok", "bad", "stale", "replayed"]


def derive_key(secret: str | bytes, purpose: str) -> bytes:
    """A key for ``purpose`` derived from the shared secret: every pod derives the same one."""
    key = secret.encode() if isinstance(secret, str) else secret
    return hmac.new(key, b"prefix-gateway:" + purpose.encode(), hashlib.sha256).digest()


class _Seen:
    """One sender's newest accepted sequence and which of the ``REPLAY_WINDOW`` before it were accepted."""

    __slots__ = ("mask", "newest", "stamp")

    def __init__(self, sequence: int, stamp_s: float) -> None:
        self.newest = sequence
        self.mask = 1  # bit i: sequence newest - i accepted
        self.stamp = stamp_s  # the newest accepted message's time (sender's clock)

    def accept(self, sequence: int, stamp_s: float) -> bool:
        """Record ``sequence``; False if it was seen already or is too far behind."""
        if sequence > self.newest:
            shift = sequence - self.newest
            self.mask = ((self.mask << shift) | 1) & _WINDOW_MASK if shift < REPLAY_WINDOW else 1
            self.newest = sequence
            self.stamp = max(self.stamp, stamp_s)
            return True
        behind = self.newest - sequence
        if behind >= REPLAY_WINDOW or self.mask >> behind & 1:
            return False
        self.mask |= 1 << behind
        return True


class Signer:
    """Seal outgoing payloads and open incoming ones with one shared secret (see the module docstring)."""

    def __init__(self, secret: str | bytes, now: float | None = None) -> None:
        self._key = secret.encode() if isinstance(secret, str) else secret
        self.sender = secrets.token_hex(8).encode()  # this process's boot id
        self._sequence = 0
        self.started = time.time() if now is None else now
        self._senders: OrderedDict[bytes, _Seen] = OrderedDict()  # least recently heard first

    def derive_key(self, purpose: str) -> bytes:
        return derive_key(self._key, purpose)

    def _mac(self, header: bytes, payload: bytes) -> bytes:
        return hmac.new(self._key, header + b":" + payload, hashlib.sha256).hexdigest().encode()

    def seal(self, payload: bytes, now: float | None = None) -> bytes:
        self._sequence += 1
        stamp = str(int((time.time() if now is None else now) * 1000)).encode()
        header = b"%s:%d:%s" % (self.sender, self._sequence, stamp)
        return PREFIX + header + b":" + self._mac(header, payload) + b":" + payload

    def open(self, message: bytes | str, now: float | None = None) -> bytes | None:
        """The payload of a valid, fresh, first-seen envelope; None for anything else."""
        return self.verify(message, now)[0]

    def verify(self, message: bytes | str, now: float | None = None) -> tuple[bytes | None, Verdict]:
        """``(payload, "ok")``, or ``(None, why)``: ``bad`` (unsigned, malformed, wrong MAC),
        ``stale`` (outside ``MAX_SKEW_S``) or ``replayed`` (see the module docstring)."""
        data = message.encode("utf-8", "surrogateescape") if isinstance(message, str) else message
        if not data.startswith(PREFIX):
            return None, "bad"
        parts = data[len(PREFIX) :].split(b":", 4)
        if len(parts) != 5:
            return None, "bad"
        sender, sequence, stamp, mac, payload = parts
        if not (len(sender) == 16 and sequence.isdigit() and len(sequence) <= 19 and stamp.isdigit()):
            return None, "bad"
        if len(stamp) > 16:
            return None, "bad"
        header = b"%s:%s:%s" % (sender, sequence, stamp)
        if not hmac.compare_digest(mac, self._mac(header, payload)):
            return None, "bad"
        now = time.time() if now is None else now
        sealed_at = int(stamp) / 1000.0
        if abs(now - sealed_at) > MAX_SKEW_S:
            return None, "stale"
        if sealed_at < self.started - START_SLACK_S:  # before this process listened: it cannot know
            return None, "replayed"
        self._forget_silent(now)
        seen = self._senders.get(sender)
        if seen is None:
            self._senders[sender] = _Seen(int(sequence), sealed_at)
            while len(self._senders) > MAX_SENDERS:
                self._senders.popitem(last=False)
        else:
            if not seen.accept(int(sequence), sealed_at):
                return None, "replayed"
            self._senders.move_to_end(sender)
        return payload, "ok"

    def _forget_silent(self, now: float) -> None:
        """Drop senders not heard for ``2 * MAX_SKEW_S``: their messages are refused for age by now."""
        senders = self._senders
        while senders:
            sender, seen = next(iter(senders.items()))
            if now - seen.stamp <= 2 * MAX_SKEW_S:
                break
            del senders[sender]

    @property
    def senders(self) -> int:
        """Senders whose sequences are remembered now."""
        return len(self._senders)
