"""``POST /v1/embeddings``: deterministic small vectors, so the gateway can proxy embeddings too.

Each vector is a signed bag of hashed token ids, L2-normalized: the same input always
gives the same vector, and inputs sharing tokens point in similar directions (which
makes the numbers look plausible in demos).  Embeddings skip the generation engine and
the prefix cache, but count their prompt tokens like vLLM's pooling requests do.
"""

from __future__ import annotations

import base64
import json
import math
import struct
import time
from typing import Any

from gateway.sim.asgi import Receive, Send
from gateway.sim.protocol import APIError, EmbeddingRequest, check_token_ids, parse
from gateway.sim.replica import Replica


def embed(tokens: list[int], dim: int) -> list[float]:
    vec = [0.0] * dim
    for position, tok in enumerate(tokens):
        h = (tok * 0x9E3779B1 + 0x7F4A7C15) & 0xFFFFFFFF
        weight = 1.0 / (1.0 + 0.01 * position)
        vec[h % dim] += weight if h & 0x10000 else -weight
        vec[(h >> 20) % dim] += 0.5 * weight
    norm = math.sqrt(sum(v * v for v in vec)) or 1.0
    return [v / norm for v in vec]


async def embeddings(replica: Replica, body: bytes, receive: Receive, send: Send) -> tuple[int, bytes]:
    req: EmbeddingRequest = parse(EmbeddingRequest, body)
    model, _lora = replica.resolve_model(req.model)
    raw = req.input
    tok = replica.tokenizer
    inputs: list[list[int]]
    if isinstance(raw, str):
        inputs = [tok.encode(raw)]
    elif not raw:
        raise APIError(400, "Input cannot be empty.", param="input")
    elif isinstance(raw[0], int):
        inputs = [list(raw)]  # type: ignore[arg-type]
    elif isinstance(raw[0], str):
        inputs = [tok.encode(t) for t in raw]  # type: ignore[arg-type]
    else:
        inputs = [list(x) for x in raw]  # type: ignore[union-attr]
    if req.encoding_format not in ("float", "base64"):
        raise APIError(400, f"unsupported encoding_format {req.encoding_format!r}", param="encoding_format")
    dim = req.dimensions or replica.options.embedding_dim
    data: list[dict[str, Any]] = []
    total = 0
    for index, ids in enumerate(inputs):
        if not ids:
            raise APIError(400, "Input cannot be empty.", param="input")
        check_token_ids(ids, "input")
        replica.check_prompt_len(len(ids), what="input")
        total += len(ids)
        vector = embed(ids, dim)
        encoded: Any = vector
        if req.encoding_format == "base64":
            encoded = base64.b64encode(struct.pack(f"<{dim}f", *vector)).decode()
        data.append({"index": index, "object": "embedding", "embedding": encoded})
    metrics = replica.metrics
    metrics.prompt_tokens.inc(total)
    metrics.success["stop"].inc(len(inputs))
    replica.engine.total_prompt_tokens += total
    payload = {
        "id": "embd-" + replica.new_id(),
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0},
    }
    return 200, json.dumps(payload, separators=(",", ":")).encode()
