"""TextTail: chunk resolution past the token window for precise replicas."""

from gateway.kv_events.text_tail import TextTail


def test_extend_follows_recorded_run_up_to_most() -> None:
    tail = TextTail()
    keys = [10, 11, 12, 13, 14, 15]
    tail.record("r0", keys[2:5])  # text keys 3..5 (1-based depths 3, 4, 5)
    assert tail.extend("r0", keys, 2, 3) == 5
    assert tail.extend("r0", keys, 2, 1) == 3  # never more than `most` past the model's depth
    assert tail.extend("r1", keys, 2, 3) == 2  # another replica recorded none
    assert tail.extend("r0", [10, 11, 99, 13], 2, 3) == 2  # a different chunk stops the run


def test_forget_and_withdraw_and_bound() -> None:
    tail = TextTail(max_keys=4)
    tail.record("r0", [1, 2, 3])
    tail.forget("r0")  # the engine cleared its cache
    assert tail.extend("r0", [1, 2, 3], 0, 3) == 0
    tail.record("r0", [1, 2, 3])
    tail.withdraw("r0", [2])
    assert tail.extend("r0", [1, 2, 3], 0, 3) == 1
    tail.record("r1", [7, 8, 9])
    assert len(tail) <= 4  # bounded: the oldest entries went first
    assert tail.extend("r1", [7, 8, 9], 0, 3) == 3
