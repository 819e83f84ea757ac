"""Through the gateway and 4 simulated replicas: prefixes land where they are cached.

Conversations stay on the replica that holds their history (cached tokens grow turn over
turn), requests sharing a long system prompt hit the cache after the first, and when a
replica dies its conversations move to the others and keep working.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from e2e_helpers import BLOCK, Conversation, ask, client, gateway, prompt_tokens_of, whole_blocks
from polling import wait_for

from gateway.sim.launcher import ReplicaGroup

TOPICS = ["astronomy", "baking", "chess", "diving", "etching", "falconry", "gardening", "hiking"]
QUESTIONS = ["Where do I start?", "What tools do I need?", "How do I practise?", "What comes next?"]


def assert_grows_with_history(conv: Conversation) -> None:
    """Turn k+1 reuses at least turn k's whole prompt blocks (less one block of re-tokenization slack)."""
    for before, after in zip(conv.replies, conv.replies[1:], strict=False):
        assert after.cached_tokens is not None and before.cached_tokens is not None
        assert after.cached_tokens >= whole_blocks(before.prompt_tokens) - BLOCK, (conv.topic, before, after)
        assert after.cached_tokens > before.cached_tokens


def test_conversations_stay_on_the_replica_that_holds_their_history(fleet: ReplicaGroup) -> None:
    with gateway(fleet.urls) as gw:
        sdk = client(gw)
        conversations = [Conversation(topic) for topic in TOPICS]
        for question in QUESTIONS:  # interleaved, as many users would be
            for conv in conversations:
                conv.turn(sdk, question)
    homes = {}
    for conv in conversations:
        replicas = {reply.replica for reply in conv.replies}
        assert len(replicas) == 1, (conv.topic, [r.replica for r in conv.replies])
        homes[conv.topic] = replicas.pop()
        assert_grows_with_history(conv)
        assert conv.replies[-1].cached_tokens >= 0.8 * conv.replies[-1].prompt_tokens
    assert len(set(homes.values())) > 1, homes  # the conversations were spread, not piled on one replica


def test_a_shared_system_prompt_hits_the_cache_after_the_first_request(fleet: ReplicaGroup) -> None:
    system = {"role": "system", "content": "You are the support agent of Example Corp. " + "Follow the policy. " * 120}
    shared = whole_blocks(prompt_tokens_of([system]))
    assert shared >= 400
    with gateway(fleet.urls) as gw:
        sdk = client(gw)
        replies = [
            ask(sdk, [system, {"role": "user", "content": f"Question number {i}: {q}"}])
            for i, q in enumerate(QUESTIONS * 3)
        ]
    assert replies[0].cached_tokens == 0  # a fresh fleet: the first one computes the prefix
    for reply in replies[1:]:
        assert reply.cached_tokens is not None and reply.cached_tokens >= shared, reply
    assert len({r.replica for r in replies}) == 1  # one at a time: the holder is never busy


def test_a_killed_replicas_conversations_move_and_still_succeed(fleet: ReplicaGroup) -> None:
    with gateway(fleet.urls) as gw:
        sdk = client(gw)
        conversations = [Conversation(topic) for topic in TOPICS]
        for question in QUESTIONS[:2]:
            for conv in conversations:
                conv.turn(sdk, question)
        home = {conv.topic: conv.replies[-1].replica for conv in conversations}
        victim = Counter(home.values()).most_common(1)[0][0]
        fleet.kill(int(victim[1:]))  # a crash: the next request to it is refused and retried elsewhere
        for question in QUESTIONS[2:]:
            for conv in conversations:
                conv.turn(sdk, question)  # every turn succeeds (the SDK raises otherwise)
        # Marked down by health checks or consecutive failures: when depends on timing, so poll.
        wait_for(lambda: not gw.gateway.replicas[victim].healthy, timeout=15, what=f"{victim} marked down")
        assert gw.gateway.stats.by_route["main"].errors == 0
    for conv in conversations:
        after = [r.replica for r in conv.replies[2:]]
        assert victim not in after
        if home[conv.topic] == victim:
            assert after[0] == after[1]  # moved once, then stays where its history now is
            assert conv.replies[3].cached_tokens >= whole_blocks(conv.replies[2].prompt_tokens) - BLOCK
        else:
            assert after == [home[conv.topic]] * 2  # the others did not move
            assert_grows_with_history(conv)


@pytest.mark.slow
def test_conversations_behind_a_10k_token_shared_head_keep_their_replica_and_spread(fleet: ReplicaGroup) -> None:
    """An agent tenant: one ~10k-token system prompt (longer than the 4,096-token window),
    16 conversations at once.  Keys cover the whole prompt, so each conversation is told
    apart by its own messages: it stays with its history while the tenant spreads."""
    rnd = random.Random(5)
    head = " ".join(f"{rnd.choice(['tool', 'rule', 'step', 'case'])}{rnd.randrange(10_000)}" for _ in range(4_500))
    system = {"role": "system", "content": "You are the operations agent. " + head}
    assert prompt_tokens_of([system]) > 9_000
    conversations = [Conversation(f"ticket {i}", messages=[system]) for i in range(16)]
    turns = 5
    # Slow health checks: on a loaded test machine a 1 s timeout can eject a busy replica, which
    # (correctly) moves its conversations — not what this test is about.
    health = {"interval_s": 2.0, "timeout_s": 10.0, "unhealthy_threshold": 3, "eject_s": 0.5}
    with gateway(fleet.urls, health=health) as gw:
        sdk = client(gw)
        start = threading.Barrier(len(conversations))

        def run(conv: Conversation) -> None:
            start.wait(timeout=30)
            for t in range(turns):
                conv.turn(sdk, f"Step {t}: what next for {conv.topic}?")

        with ThreadPoolExecutor(len(conversations)) as pool:
            list(pool.map(run, conversations))
    pairs = [(a, b) for conv in conversations for a, b in zip(conv.replies, conv.replies[1:], strict=False)]
    kept = sum(a.replica == b.replica for a, b in pairs)
    moves = len(conversations) * (turns - 1)
    assert kept >= 0.95 * moves, [[r.replica for r in c.replies] for c in conversations]
    homes = Counter(conv.replies[-1].replica for conv in conversations)
    assert len(homes) == 4, homes
    for conv in conversations:  # later turns reuse the head and the conversation's own history
        last = conv.replies[-1]
        assert last.cached_tokens is not None and last.cached_tokens >= 0.9 * last.prompt_tokens, last
