"""The benchmark's workload generators: deterministic, shaped as documented, prefix structure intact."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest

from benchmarks.workloads import WORKLOAD_NAMES, builders
from benchmarks.workloads.agent import AgentSpec, build_agent_workload
from benchmarks.workloads.agent_tools import (
    LongHeadSpec,
    ToolLoopSpec,
    build_agent_long_workload,
    build_agent_toolloop_workload,
)
from benchmarks.workloads.control import ControlSpec, build_control_workload
from benchmarks.workloads.mooncake import (
    BlockTokens,
    MooncakeSpec,
    build_mooncake,
    ceiling_hit_rate,
    sample_sessions,
)
from benchmarks.workloads.rag import RagSpec, build_rag_workload
from benchmarks.workloads.text import words
from gateway.tokens.chat_template import chat_tokens
from gateway.tokens.tokenizer import get_tokenizer

SMALL_AGENT = AgentSpec(tenants=3, system_tokens=(200, 400), conversations=6, oneoffs=4, span_s=20.0)
ISO = re.compile(r"^Current time: \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z\nRequest ID: [0-9a-f-]{36}\n\n")


def test_registry_names_match_builders():
    assert set(WORKLOAD_NAMES) == set(builders())


def test_filler_words_are_exactly_one_token_each():
    tok = get_tokenizer("cl100k_base")
    text = words(random.Random(7), 300)
    assert len(tok.encode(text)) == 300
    assert text.startswith(" ")


def test_agent_is_deterministic_and_seeded():
    a = build_agent_workload(seed=3, spec=SMALL_AGENT)
    b = build_agent_workload(seed=3, spec=SMALL_AGENT)
    c = build_agent_workload(seed=4, spec=SMALL_AGENT)
    dump = lambda w: json.dumps([(r.t, r.body, r.session) for r in w.requests])  # noqa: E731
    assert dump(a) == dump(b)
    assert dump(a) != dump(c)


def test_agent_volatile_header_on_top_and_stable_rest():
    wl = build_agent_workload(seed=1, spec=SMALL_AGENT)
    assert wl.normalize == "relocate" and all(r.endpoint == "chat" for r in wl.requests)
    by_session: dict[str, list] = {}
    for r in wl.requests:
        system = r.body["messages"][0]
        assert system["role"] == "system"
        assert ISO.match(system["content"]), system["content"][:120]
        by_session.setdefault(r.session, []).append(r)
    convs = [reqs for s, reqs in by_session.items() if "conv" in s and len(reqs) >= 2]
    assert convs, "expected multi-turn conversations"
    for reqs in convs:
        first, second = reqs[0].body["messages"], reqs[1].body["messages"]
        # the top differs every request, the rest of the system prompt never does
        assert first[0]["content"] != second[0]["content"]
        assert ISO.sub("", first[0]["content"]) == ISO.sub("", second[0]["content"])
        # the history is resent: turn 1's messages are a prefix of turn 2's, plus the reply
        assert second[1 : len(first)] == first[1:]
        assert second[len(first)]["role"] == "assistant"
        assert reqs[1].t >= reqs[0].t


def test_agent_prompt_tokens_are_the_simulators_count_and_times_sorted():
    wl = build_agent_workload(seed=2, spec=SMALL_AGENT)
    tok = get_tokenizer("cl100k_base")
    for r in wl.requests[:5]:
        assert r.prompt_tokens == len(chat_tokens(tok, r.body["messages"]))
    assert [r.t for r in wl.requests] == sorted(r.t for r in wl.requests)
    kinds = {r.kind for r in wl.requests}
    assert {"turn", "oneoff"} <= kinds | {"unique"}


def _trace(tmp_path, rows):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


ROWS = [
    {"timestamp": 0, "input_length": 1100, "output_length": 40, "hash_ids": [1, 2, 3]},
    {"timestamp": 1000, "input_length": 600, "output_length": 5, "hash_ids": [7, 8]},
    {"timestamp": 2000, "input_length": 1500, "output_length": 90, "hash_ids": [1, 2, 4]},
    {"timestamp": 3000, "input_length": 300, "output_length": 9, "hash_ids": [9]},
    {"timestamp": 9000, "input_length": 1024, "output_length": 9, "hash_ids": [1, 5]},
]
SPEC = MooncakeSpec(
    name="t", file="trace.jsonl", namespace="ns", session_depth=0, session_fraction=1.0, window_s=(0.0, 5.0)
)


def test_block_tokens_are_fixed_per_id_and_namespaced():
    a, b = BlockTokens("ns"), BlockTokens("ns")
    assert a.block(5) == b.block(5) and len(a.block(5)) == 512
    assert a.block(5) != a.block(6)
    assert BlockTokens("other").block(5) != a.block(5)


def test_trace_prompts_share_exactly_their_common_hash_prefix(tmp_path):
    _trace(tmp_path, ROWS)
    wl = build_mooncake(SPEC, directory=tmp_path)
    assert [r.prompt_tokens for r in wl.requests] == [1100, 600, 1500, 300]  # 9 s row is outside the window
    tok = get_tokenizer("cl100k_base")
    texts = [r.body["prompt"] for r in wl.requests]
    assert all(isinstance(t, str) for t in texts)  # text: the peer router takes string prompts only
    first, third = tok.encode(texts[0]), tok.encode(texts[2])
    assert len(first) == 1100 and len(third) == 1500  # the text is exactly input_length cl100k tokens
    assert first[:1024] == third[:1024]  # hash ids 1, 2 shared
    assert first[1024:1100] != third[1024:1100]  # id 3 vs id 4
    assert all(r.endpoint == "completions" and r.max_tokens <= SPEC.max_output_tokens for r in wl.requests)
    assert [r.t for r in wl.requests] == [0.0, 1.0, 2.0, 3.0]


def test_session_sampling_keeps_whole_groups(tmp_path):
    rows = [
        {"timestamp": i * 10, "input_length": 600, "output_length": 1, "hash_ids": [i % 25, 1000 + i]}
        for i in range(500)
    ]
    spec = MooncakeSpec(name="t", file="x", namespace="ns", session_depth=0, session_fraction=0.3, window_s=(0.0, 1e6))
    kept = sample_sessions(rows, spec, 0.3, seed=0)
    groups = {key for _, key in kept}
    assert 0 < len(groups) < 25
    # every request of a kept group is kept: sampling never splits a session
    assert len(kept) == sum(1 for r in rows if f"h{r['hash_ids'][0]}" in groups)
    assert sample_sessions(rows, spec, 0.3, seed=0) == kept


def test_ceiling_hit_rate_counts_full_blocks_seen_before():
    rows = [
        {"input_length": 1100, "hash_ids": [1, 2, 3]},
        {"input_length": 1500, "hash_ids": [1, 2, 4]},
    ]
    # second request hits blocks 1 and 2 (1024 tokens) out of 2600 total tokens
    assert ceiling_hit_rate(rows) == pytest.approx(1024 / 2600)


def test_control_prompts_share_nothing():
    wl = build_control_workload(seed=0, spec=ControlSpec(requests=50, median_tokens=300, min_tokens=32))
    tok = get_tokenizer("cl100k_base")
    ids = [tok.encode(r.body["prompt"]) for r in wl.requests]
    firsts = [p[0] for p in ids]
    assert len(set(firsts)) == len(firsts)
    assert all(len(p) == r.prompt_tokens for p, r in zip(ids, wl.requests, strict=True))
    again = build_control_workload(seed=0, spec=ControlSpec(requests=50, median_tokens=300, min_tokens=32))
    assert [r.body for r in again.requests] == [r.body for r in wl.requests]


SMALL_LONG = LongHeadSpec(tenants=2, conversations=6, turns=(2, 4), span_s=20.0)
SMALL_LOOP = ToolLoopSpec(tenants=2, system_tokens=(200, 300), tool_tokens=(200, 300), loops=4, steps=(3, 5))
TRACE = re.compile(r"^Current time: \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z\nTrace ID: [0-9a-f]{32}\n\n")


def _dump(wl):
    return json.dumps([(r.t, r.body, r.session, r.prompt_tokens) for r in wl.requests])


def test_agent_long_heads_exceed_the_old_window_and_conversations_part_right_after():
    wl = build_agent_long_workload(seed=1, spec=SMALL_LONG)
    assert _dump(wl) == _dump(build_agent_long_workload(seed=1, spec=SMALL_LONG))
    assert _dump(wl) != _dump(build_agent_long_workload(seed=2, spec=SMALL_LONG))
    assert wl.normalize == "off" and wl.reference is None
    tok = get_tokenizer("cl100k_base")
    by_session: dict[str, list] = {}
    for r in wl.requests:
        by_session.setdefault(r.session, []).append(r)
    heads = {}
    for session, reqs in by_session.items():
        tenant = session.split("-")[0]
        system = reqs[0].body["messages"][0]
        assert system["role"] == "system" and '"type": "function"' in system["content"]  # tool schemas
        heads.setdefault(tenant, system["content"])
        assert system["content"] == heads[tenant]  # one shared head per tenant, never volatile
        for earlier, later in itertools.pairwise(reqs):  # each turn resends the history
            assert later.body["messages"][: len(earlier.body["messages"])] == earlier.body["messages"]
    assert len(heads) == SMALL_LONG.tenants
    assert all(len(tok.encode(h)) > 4096 for h in heads.values())
    # several conversations per tenant, parting right after the shared head
    firsts = [reqs[0].body["messages"] for reqs in by_session.values()]
    same_tenant = [m for m in firsts if m[0]["content"] == firsts[0][0]["content"]]
    assert len(same_tenant) >= 2 and same_tenant[0][1] != same_tenant[1][1]
    for r in wl.requests[:4]:
        assert r.prompt_tokens == len(chat_tokens(tok, r.body["messages"]))


def test_agent_toolloop_has_a_fresh_header_tool_steps_and_a_header_less_reference():
    wl = build_agent_toolloop_workload(seed=1, spec=SMALL_LOOP)
    assert _dump(wl) == _dump(build_agent_toolloop_workload(seed=1, spec=SMALL_LOOP))
    assert wl.normalize == "relocate" and wl.reference is not None
    assert len(wl.reference) == len(wl.requests)
    tok = get_tokenizer("cl100k_base")
    headers = set()
    by_session: dict[str, list] = {}
    for r, ref in zip(wl.requests, wl.reference, strict=True):
        system, ref_system = r.body["messages"][0]["content"], ref.body["messages"][0]["content"]
        match = TRACE.match(system)
        assert match, system[:100]
        headers.add(match.group(0))
        # the reference is the same request, at the same time, without the header
        assert system[match.end() :] == ref_system and r.body["messages"][1:] == ref.body["messages"][1:]
        assert ref.t == r.t and ref.session == r.session
        assert ref.prompt_tokens == len(chat_tokens(tok, ref.body["messages"])) < r.prompt_tokens
        by_session.setdefault(r.session, []).append(ref)
    assert len(headers) == len(wl.requests)  # new values every step
    for steps in by_session.values():
        first = steps[0].body["messages"]
        assert [m["role"] for m in first] == ["system", "user"]  # the task
        for earlier, later in itertools.pairwise(steps):
            before, after = earlier.body["messages"], later.body["messages"]
            assert after[: len(before)] == before  # each step resends everything before it
            call, result = after[len(before) :]
            assert call["role"] == "assistant" and call["content"] is None
            assert result == {**result, "role": "tool", "tool_call_id": call["tool_calls"][0]["id"]}
            json.loads(call["tool_calls"][0]["function"]["arguments"])


SMALL_RAG = RagSpec(requests=60, documents=12, doc_tokens=(100, 300), system_tokens=80, question_tokens=(5, 20))


def test_rag_prompts_are_system_then_a_popular_document_then_a_question():
    wl = build_rag_workload(seed=2, spec=SMALL_RAG)
    assert _dump(wl) == _dump(build_rag_workload(seed=2, spec=SMALL_RAG))
    assert _dump(wl) != _dump(build_rag_workload(seed=3, spec=SMALL_RAG))
    tok = get_tokenizer("cl100k_base")
    ids = [tok.encode(r.body["prompt"]) for r in wl.requests]
    assert all(len(p) == r.prompt_tokens for p, r in zip(ids, wl.requests, strict=True))
    head = ids[0][:80]
    assert all(p[:80] == head for p in ids)  # one shared system prompt
    # Requests whose first document is the same share the system prompt and the whole document
    # (at least 100 tokens more), then part at the question or a second document.
    by_doc: dict[str, list[list[int]]] = {}
    for r, p in zip(wl.requests, ids, strict=True):
        by_doc.setdefault(r.kind, []).append(p)
    popular = max(by_doc.values(), key=len)
    assert len(popular) >= 8  # Zipf: the top document draws many questions
    columns = enumerate(zip(*popular, strict=False))
    shared = next((i for i, column in columns if len(set(column)) > 1), min(map(len, popular)))
    assert 80 + 100 <= shared < min(map(len, popular))
    assert len({r.session for r in wl.requests}) == len(wl.requests)  # single-turn
    assert [r.t for r in wl.requests] == sorted(r.t for r in wl.requests)


def test_tenants_floods_in_bursts_ten_times_the_chat_tenants_requests():
    from benchmarks.replay import prepare
    from benchmarks.workloads import TENANT_HEADER
    from benchmarks.workloads.tenants import TenantsSpec, build_tenants_workload

    spec = TenantsSpec(jobs=3, job_requests=20, users=3, turns=2)
    wl = build_tenants_workload(seed=1, spec=spec)
    assert wl.requests == build_tenants_workload(seed=1, spec=spec).requests  # deterministic
    batch = [r for r in wl.requests if r.tenant == "batch"]
    chat = [r for r in wl.requests if r.tenant == "chat"]
    assert len(batch) == 10 * len(chat) == 60
    # a job's requests arrive within one burst and share the job's document
    for j in range(spec.jobs):
        job = [r for r in batch if r.session == f"job{j}"]
        assert max(r.t for r in job) - min(r.t for r in job) <= spec.burst_s
        heads = {tuple(r.body["prompt"].split()[: spec.doc_tokens[0]]) for r in job}
        assert len(heads) == 1
    # a user's next turn resends the previous one
    turns = [r for r in chat if r.session == "user0"]
    assert turns[1].body["prompt"].startswith(turns[0].body["prompt"])
    # the replayer names each request's tenant in the fairness header
    wire = prepare(wl.requests, "m", 1.0)
    assert {w.headers[TENANT_HEADER] for w in wire} == {"batch", "chat"}
