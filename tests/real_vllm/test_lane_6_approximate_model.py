"""Real engine: with KV events off, the approximate model alone predicts to the engine's block.

``kv_events.enabled: false``: no replica is matched from its events, so the affinity model is
the gateway's only view of what each engine holds. It stores a key every
``affinity_stride_tokens`` (64) tokens of prompt: every key at the CPU engines' 128-token blocks
(and 64, after test 4 restarted r1). A fixed stride of 4 keys matched 512-token steps there, so a
document of 30 engine blocks was predicted as 28 until events came (seen on the simulator at
128-token blocks: each of a batch job's requests two blocks short). A second question on each
document must be predicted exactly as vLLM reports it, also where the document's whole blocks
are not a multiple of 4.
"""

from __future__ import annotations

import pytest

from tests.real_vllm import engine, workload
from tests.real_vllm.lane import Observation, front
from tests.real_vllm.test_lane_2_cache_changes import chat

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(600)]


def test_the_approximate_model_predicts_a_shared_document_to_the_engines_block(
    real_replicas: list[engine.Replica],
) -> None:
    with front(real_replicas, {"kv_events": {"enabled": False}}) as f:
        blocks = {name: f.stats()["replicas"][name]["engine"]["block_size"] for name in f.replicas}
        seconds: list[Observation] = []
        for i in range(12):
            body = chat(9901 + 10 * i, words=700 + 61 * i)
            first = f.send(f"approx-{i}", "chat", body)
            question = {"role": "user", "content": workload.text(40, 7001 + i)}
            second = f.send(f"approx-{i}-q2", "chat", {**body, "messages": [body["messages"][0], question]})
            assert second.replica == first.replica, "the document's holder takes its second question"
            assert second.cached_tokens, f"vLLM cached the document on {second.replica}"
            assert second.agrees, (
                f"{second.replica} ({blocks[second.replica]}-token blocks): predicted {second.predicted}, "
                f"vLLM {second.cached_tokens} of {second.prompt_tokens}"
            )
            seconds.append(second)
            off_stride = [o for o in seconds if (o.cached_tokens or 0) // blocks[o.replica] % 4]
            if len({o.replica for o in seconds}) == len(f.replicas) and len(off_stride) >= 2:
                break
        assert {o.replica for o in seconds} == set(f.replicas), "both replicas served a document"
        assert len(off_stride) >= 2, "documents whose whole blocks a 4-key stride would not see"
        assert {name: f.mode(name) for name in f.replicas} == {name: "approximate" for name in f.replicas}
