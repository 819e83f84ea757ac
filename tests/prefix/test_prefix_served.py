"""The prefix policy keeps only what a replica served: an attempt without a 2xx answer takes
back the keys its decision added (``forget_attempt``), never what the replica held before, and
tells the index's sink (peers take them back too); a served twin of that attempt mends it."""

from __future__ import annotations

from policy_helpers import NAMES, chain, policy, req, views

from gateway.routing.base import ReplicaView


class Heard:
    """A record sink that keeps what it was told (as the shared-state sync would publish)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, list[int]]] = []
        self.taken: list[tuple[str, list[int]]] = []  # withdrawals

    def recorded(self, replica: str, stored: list[int], prompt_tokens: int | None, weights: object) -> None:
        self.records.append((replica, list(stored)))

    def withdrawn(self, replica: str, keys: list[int]) -> None:
        self.taken.append((replica, list(keys)))

    def taken_keys(self) -> set[int]:
        return {key for _, keys in self.taken for key in keys}


def test_an_unserved_attempt_takes_back_only_its_own_keys_and_tells_the_sink() -> None:
    p = policy(affinity_stride_blocks=1)
    heard = Heard()
    p.index.attach_sink(heard)  # type: ignore[arg-type]
    head = chain(24, 1)
    served = p.choose(req(head + chain(4, 2), rid="a"), views())
    refused_keys = head + chain(6, 3)
    refused = p.choose(req(refused_keys, rid="b"), views())
    assert refused.replica == served.replica  # the head's holder
    p.forget_attempt(req(refused_keys, rid="b"), refused)
    assert p.index.match(refused_keys, NAMES) == {served.replica: 24}  # the head stayed
    assert heard.taken == [(served.replica, refused.detail["recorded_keys"])]
    assert heard.taken_keys() == set(refused_keys[24:])  # only what the refused decision added


def test_a_served_twin_of_an_unserved_attempt_records_the_prompt_again() -> None:
    """Two requests with one new prompt, on one replica: the first added the keys and was
    refused (or abandoned); the second found them held, added none, and was served."""
    p = policy()
    heard = Heard()
    p.index.attach_sink(heard)  # type: ignore[arg-type]
    keys = chain(40, 4)
    first = p.choose(req(keys, rid="a"), views())
    second = p.choose(req(keys, rid="b"), views())
    assert second.replica == first.replica and "recorded_keys" not in second.detail
    p.forget_attempt(req(keys, rid="a"), first)
    assert p.index.match(keys, NAMES) == {}
    p.observe(req(keys, rid="b"), second, None)  # served
    assert p.index.match(keys, NAMES) == {first.replica: 40}
    assert len(heard.records) == 3 and heard.records[-1][0] == first.replica  # both decisions, and again now
    p.observe(req(keys, rid="b"), second, None)  # held: nothing more is recorded or published
    assert len(heard.records) == 3


def test_a_served_twin_does_not_bring_back_a_replica_that_left() -> None:
    p = policy()
    keys = chain(8, 5)
    first = p.choose(req(keys, rid="a"), views())
    second = p.choose(req(keys, rid="b"), views())
    p.forget_attempt(req(keys, rid="a"), first)
    p.set_members([ReplicaView(n) for n in NAMES if n != second.replica])  # it left meanwhile
    p.observe(req(keys, rid="b"), second, None)
    assert not p.index.knows(second.replica)


def test_without_a_withdrawal_a_served_request_changes_nothing() -> None:
    """The mend is for withdrawals only: a prompt the index dropped otherwise (its LRU) while
    the request ran stays dropped, as before."""
    p = policy()
    keys = chain(8, 6)
    decision = p.choose(req(keys), views())
    p.index.withdraw(decision.replica, list(keys))  # what an eviction does, without forget_attempt
    p.observe(req(keys), decision, None)
    assert p.index.match(keys, NAMES) == {}
