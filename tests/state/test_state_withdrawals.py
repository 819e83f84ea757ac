"""Withdrawals on the shared channel: a record whose replica did not serve is taken back on peers.

The index records a placement at decision time and publishes it; when the attempt gets no
2xx answer the keys it added are withdrawn locally (``AffinityIndex.unrecord``) and the
withdrawal travels in the same ordered queue as the records, in a field older versions ignore.
The end-to-end cases (a 400, a peer over a real Redis) are in
``tests/e2e_prefix/test_e2e_served_only.py``.
"""

from __future__ import annotations

import json
import random

import pytest

from gateway.routing.affinity import AffinityIndex
from gateway.state.affinity_sync import AffinitySync
from gateway.state.wire import Record, Withdrawal, decode, decode_records, decode_withdrawn, encode, parse_message

NAMES = ["r0", "r1", "r2", "r3"]


def index() -> AffinityIndex:
    idx = AffinityIndex(10_000, stride=4)
    idx.set_members(NAMES)
    return idx


def chain(n: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.getrandbits(64) for _ in range(n)]


def unstarted(idx: AffinityIndex) -> AffinitySync:
    """A sync that queues what ``idx`` tells it but never connects (batches taken by hand)."""
    return AffinitySync("redis://127.0.0.1:1/0", "unused", {"chat": idx})


def publish(sync: AffinitySync) -> bytes:
    """The next message the publisher would send, built the way its loop builds it."""
    batch, withdrawn, _ = sync._next_batch()
    return encode(sync.pod_id, batch, withdrawn=withdrawn)


def test_withdrawals_travel_in_a_field_older_versions_ignore() -> None:
    keys = chain(5, 1)
    records = [Record("chat", "r1", keys, 900)]
    withdrawn = [(0, Withdrawal("chat", "r2", keys[:2])), (1, Withdrawal("chat", "r1", [2**64 - 1]))]
    payload = encode("pod-a", records, withdrawn=withdrawn)
    message = parse_message(payload)
    assert decode_withdrawn(message, len(records)) == withdrawn
    # what an older version reads of the same message: its records, unchanged
    assert decode(payload) == ("pod-a", records)
    assert all(len(row) == 4 for row in json.loads(payload)["records"])
    assert decode_withdrawn(parse_message(encode("pod-a", records)), 1) == []  # none: an older sender


@pytest.mark.parametrize(
    "rows",
    [
        "x",
        [[0, "chat", "r1"]],
        [["0", "chat", "r1", "AAAAAAAAAAA="]],
        [[0, 1, "r1", "AAAAAAAAAAA="]],
        [[0, "chat", "r1", "not base64!"]],
        [[0, "chat", "r1", ""]],  # no keys
        [[2, "chat", "r1", "AAAAAAAAAAA="]],  # after records the message does not hold
        [[-1, "chat", "r1", "AAAAAAAAAAA="]],
        [[1, "chat", "r1", "AAAAAAAAAAA="], [0, "chat", "r1", "AAAAAAAAAAA="]],  # out of order
    ],
)
def test_malformed_withdrawals_are_rejected(rows: object) -> None:
    with pytest.raises(ValueError):
        decode_withdrawn({"withdrawn": rows}, 1)


def test_a_withdrawn_record_is_taken_back_on_the_peer_and_the_head_stays() -> None:
    a_index, b_index = index(), index()
    a, b = unstarted(a_index), unstarted(b_index)
    head = chain(16, 2)
    a_index.record("r1", head)  # an earlier, served request: r1 holds the head
    b.apply(publish(a))
    refused = head + chain(12, 3)
    added = a_index.record("r1", refused)  # placed at decision time ...
    assert set(added).isdisjoint(a_index.stored_keys(head))  # ... adding only its own tail
    a_index.unrecord("r1", added)  # ... and refused by the replica (no 2xx)
    b.apply(publish(a))
    for idx in (a_index, b_index):
        assert idx.match(refused, NAMES) == {"r1": 16}  # the head it held before stays, the tail went
        assert idx.entries("r1") == len(a_index.stored_keys(head))
    assert b.stats.applied == 2 and b.stats.withdrawals_applied == 1 and a.stats.withdrawn == 0  # a never published


def test_peers_apply_records_and_withdrawals_in_the_order_they_were_made() -> None:
    """Withdraw then record again (a retry the replica served): the keys stay on the peer;
    record, withdraw, and nothing else: they go.  All in one message either way."""
    a_index, b_index = index(), index()
    a, b = unstarted(a_index), unstarted(b_index)
    keys = chain(8, 4)
    a_index.unrecord("r2", a_index.record("r2", keys))
    a_index.record("r2", keys)
    payload = publish(a)
    assert [row[0] for row in json.loads(payload)["withdrawn"]] == [1]  # after the first record
    b.apply(payload)
    assert b_index.match(keys, NAMES) == a_index.match(keys, NAMES) == {"r2": 8}

    other = chain(8, 5)
    a_index.unrecord("r3", a_index.record("r3", other))
    b.apply(publish(a))
    assert b_index.match(other, NAMES) == a_index.match(other, NAMES) == {}


def test_a_withdrawal_for_an_unknown_replica_is_skipped() -> None:
    b = unstarted(index())
    payload = encode("pod-a", [], withdrawn=[(0, Withdrawal("chat", "r9", [1])), (0, Withdrawal("other", "r0", [1]))])
    assert b.apply(payload) == 0
    assert b.stats.errors == 0 and b.stats.withdrawals_applied == 0


def test_withdrawals_share_the_records_bound_per_message() -> None:
    idx = index()
    sync = unstarted(idx)
    for seed in range(400):
        keys = chain(4, seed)
        idx.unrecord("r0", idx.record("r0", keys))
    batch, withdrawn, _ = sync._next_batch()
    assert len(batch) + len(withdrawn) == 512  # MAX_RECORDS_PER_MESSAGE
    decode_records(parse_message(encode("p", batch, withdrawn=withdrawn)))  # a peer accepts it
