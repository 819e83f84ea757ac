"""Closed-loop mixed traffic for the fault suite and ``probe_faults.py``: what each request saw.

Threads send chat completions through the official ``openai`` SDK (no retries), half of them
streaming by default, and sort every outcome into the columns of the hardening probe table:
answered, failed with a status, a stream that ended with an SSE error event, a stream cut
without one, and a request that hit the client's timeout (a hang).  Every request is bounded
by that timeout, so a run always ends.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import openai

try:  # openai >= 3.63 runs on httpx2, whose transport errors reach a stream's reader as they are
    import httpx2

    TIMEOUT_ERRORS: tuple[type[Exception], ...] = (httpx.TimeoutException, httpx2.TimeoutException)
    TRANSPORT_ERRORS: tuple[type[Exception], ...] = (httpx.HTTPError, httpx2.HTTPError)
except ImportError:  # an openai still on httpx
    TIMEOUT_ERRORS, TRANSPORT_ERRORS = (httpx.TimeoutException,), (httpx.HTTPError,)

MODEL = "demo-model"


@dataclass
class Tally:
    """Outcomes so far (guarded by the owning ``Load``'s lock)."""

    sent: int = 0
    ok: int = 0  # non-streaming answered with 200
    stream_ok: int = 0  # streams that reached their finish_reason
    failed: collections.Counter[str] = field(default_factory=collections.Counter)  # non-streaming: status/kind
    stream_failed: collections.Counter[str] = field(default_factory=collections.Counter)  # status before start
    error_events: collections.Counter[str] = field(default_factory=collections.Counter)  # by error code
    broken: int = 0  # streams cut without an error event (or truncated without a finish)
    hung: int = 0  # hit the client timeout
    replicas: collections.Counter[str] = field(default_factory=collections.Counter)  # who answered

    @property
    def done(self) -> int:
        return (
            self.ok
            + self.stream_ok
            + sum(self.failed.values())
            + sum(self.stream_failed.values())
            + sum(self.error_events.values())
            + self.broken
            + self.hung
        )

    @property
    def client_failures(self) -> int:
        """Everything a client would call a failure, error events included."""
        return self.done - self.ok - self.stream_ok

    def as_dict(self) -> dict[str, object]:
        return {
            "sent": self.sent,
            "done": self.done,
            "ok": self.ok,
            "stream_ok": self.stream_ok,
            "failed": dict(self.failed),
            "stream_failed": dict(self.stream_failed),
            "error_events": dict(self.error_events),
            "broken": self.broken,
            "hung": self.hung,
        }


class Load:
    """``concurrency`` threads sending requests until :meth:`stop`; read ``tally`` under ``lock``."""

    def __init__(
        self,
        base_url: str,
        concurrency: int,
        *,
        stream_share: float = 0.5,
        max_tokens: int = 20,
        timeout_s: float = 30.0,
        prompt: Callable[[int], str] | None = None,
    ) -> None:
        # openai.Timeout, not httpx.Timeout: openai 3.63 moved onto httpx2, whose clients refuse
        # httpx's Timeout (TypeError; every fault-suite test failed on a fresh install)
        self.client = openai.OpenAI(
            base_url=base_url, api_key="unused", max_retries=0, timeout=openai.Timeout(timeout_s, connect=5.0)
        )
        self.concurrency = concurrency
        self.stream_every = 0 if stream_share <= 0 else max(1, round(1 / stream_share))
        self.max_tokens = max_tokens
        self.prompt = prompt or (lambda n: f"fault load request {n}: tell me something " * 4)
        self.tally = Tally()
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._seq = itertools.count()
        self._threads: list[threading.Thread] = []

    # -- control -------------------------------------------------------------------------
    def start(self) -> Load:
        for i in range(self.concurrency):
            thread = threading.Thread(target=self._worker, args=(i,), name=f"load-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self, timeout_s: float = 60.0) -> bool:
        """Stop sending; wait for requests in flight (each is bounded by the client timeout)."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self.client.close()
        return not any(t.is_alive() for t in self._threads)

    def wait_done(self, count: int, timeout_s: float = 60.0) -> None:
        """Block until ``count`` more requests have finished (a deadline, never a fixed sleep)."""
        with self.lock:
            target = self.tally.done + count
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                if self.tally.done >= target:
                    return
            if time.monotonic() > deadline:
                raise AssertionError(f"load did not finish {count} more requests in {timeout_s}s")
            time.sleep(0.02)

    def snapshot(self) -> dict[str, object]:
        with self.lock:
            return self.tally.as_dict()

    # -- one worker --------------------------------------------------------------------
    def _worker(self, index: int) -> None:
        while not self._stop.is_set():
            n = next(self._seq)
            stream = self.stream_every > 0 and n % self.stream_every == 0
            with self.lock:
                self.tally.sent += 1
            if stream:
                self._one_stream(n)
            else:
                self._one(n)

    def _messages(self, n: int) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.prompt(n)}]

    def _one(self, n: int) -> None:
        try:
            raw = self.client.chat.completions.with_raw_response.create(
                model=MODEL, messages=self._messages(n), max_tokens=self.max_tokens
            )
            raw.parse()
            outcome: tuple[str, str] = ("ok", raw.headers.get("x-prefix-gateway-replica", "?"))
        except openai.APITimeoutError:
            outcome = ("hung", "")
        except openai.APIStatusError as exc:
            outcome = ("failed", str(exc.status_code))
        except openai.APIConnectionError:
            outcome = ("failed", "connection")
        with self.lock:
            t = self.tally
            if outcome[0] == "ok":
                t.ok += 1
                t.replicas[outcome[1]] += 1
            elif outcome[0] == "hung":
                t.hung += 1
            else:
                t.failed[outcome[1]] += 1

    def _one_stream(self, n: int) -> None:
        kind, detail = "broken", ""
        try:
            stream = self.client.chat.completions.create(
                model=MODEL, messages=self._messages(n), max_tokens=self.max_tokens, stream=True
            )
            finished = False
            for chunk in stream:
                if chunk.choices and chunk.choices[0].finish_reason:
                    finished = True
            kind = "ok" if finished else "broken"
        except openai.APITimeoutError:
            kind = "hung"
        except openai.APIStatusError as exc:
            kind, detail = "status", str(exc.status_code)
        except openai.APIConnectionError:
            kind, detail = "status", "connection"
        except openai.APIError as exc:  # an SSE error event in the stream
            body = exc.body if isinstance(exc.body, dict) else {}
            kind, detail = "event", str(body.get("code") or "unknown")
        except TIMEOUT_ERRORS:
            kind = "hung"
        except TRANSPORT_ERRORS:
            kind = "broken"
        with self.lock:
            t = self.tally
            if kind == "ok":
                t.stream_ok += 1
            elif kind == "hung":
                t.hung += 1
            elif kind == "status":
                t.stream_failed[detail] += 1
            elif kind == "event":
                t.error_events[detail] += 1
            else:
                t.broken += 1
