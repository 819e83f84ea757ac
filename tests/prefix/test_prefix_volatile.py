"""The volatile-span scanner: what each detector finds, what it must leave alone."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.prefix.settings import DETECTORS, RegexRule
from gateway.prefix.volatile import (
    BLOCK_CLOSE,
    BLOCK_OPEN,
    VolatileScanner,
    accept_match,
    placeholder,
    values_block,
)

SCANNER = VolatileScanner()

POSITIVE = [
    ("Current time: 2025-03-04T05:06:07Z.", "iso_datetime", "2025-03-04T05:06:07Z"),
    ("at 2025-03-04 05:06:07.123+01:00 ok", "iso_datetime", "2025-03-04 05:06:07.123+01:00"),
    ("now 2025-03-04T05:06 local", "iso_datetime", "2025-03-04T05:06"),
    ("Date: Tue, 04 Mar 2025 05:06:07 +0000\n", "rfc2822_datetime", "Tue, 04 Mar 2025 05:06:07 +0000"),
    ("sent 4 Mar 2025 05:06 GMT by", "rfc2822_datetime", "4 Mar 2025 05:06 GMT"),
    ("Tue Mar  4 05:06:07 UTC 2025 is now", "rfc2822_datetime", "Tue Mar  4 05:06:07 UTC 2025"),
    ("id 550e8400-e29b-41d4-a716-446655440000.", "uuid", "550e8400-e29b-41d4-a716-446655440000"),
    ("ID: 550E8400-E29B-41D4-A716-446655440000", "uuid", "550E8400-E29B-41D4-A716-446655440000"),
    ("ts=1717171717 end", "unix_timestamp", "1717171717"),
    ("ms 1717171717123,", "unix_timestamp", "1717171717123"),
    ("t 1717171717.25 s", "unix_timestamp", "1717171717.25"),
    ("Today is 2025-03-04.", "date", "2025-03-04"),
    ("on 04/03/2025 we", "date", "04/03/2025"),
    ("am 4.3.2025 um", "date", "4.3.2025"),
    ("Today is March 4, 2025.", "date", "March 4, 2025"),
    ("Today is 4 March 2025.", "date", "4 March 2025"),
    ("It is Tuesday, March 4th, 2025 today", "date", "Tuesday, March 4th, 2025"),
    ("meet at 05:06 sharp", "time", "05:06"),
    ("meet at 5:06 PM sharp", "time", "5:06 PM"),
    ("opens 17:30 UTC daily", "time", "17:30 UTC"),
    ("clock 23:59:59.5 now", "time", "23:59:59.5"),
    ("sha da39a3ee5e6b4b0d3255bfef95601890afd80709 ok", "hex_id", "da39a3ee5e6b4b0d3255bfef95601890afd80709"),
    ("trace=4bf92f3577b34da6a3ce929d0e0e4736;", "hex_id", "4bf92f3577b34da6a3ce929d0e0e4736"),
    ("snowflake 1234567890123456789 here", "hex_id", "1234567890123456789"),
    ("nonce Zx81kQ0pLm93NbVc7TrE2w== end", "base64_id", "Zx81kQ0pLm93NbVc7TrE2w=="),
    ("ulid 01HZX3K4W5Q9V8R7T6Y5U4I3O2 end", "base64_id", "01HZX3K4W5Q9V8R7T6Y5U4I3O2"),
    ("key sk_live_4eC39HqLyjWDarjtT1zdp7dc", "base64_id", "sk_live_4eC39HqLyjWDarjtT1zdp7dc"),
    # issue 9: what the syntactic detectors used to miss
    ("现在时间17:30。请回答", "time", "17:30"),
    ("今天是2025年3月4日。", "date", "2025年3月4日"),
    ("现在是2025年3月4日17:30:00。", "date", "2025年3月4日17:30:00"),
    ("现在是2025年3月4日 17时30分。", "date", "2025年3月4日 17时30分"),
    ("오늘은 2025년 3월 4일 입니다", "date", "2025년 3월 4일"),
    ("See you on March 4th then.", "date", "March 4th"),
    ("due the 4th of March.", "date", "4th of March"),
    ("Heute ist der 4. März 2025.", "date", "4. März 2025"),
    ("Nous sommes le 1er mars 2025.", "date", "1er mars 2025"),
    ("Hoy es 4 de marzo de 2025.", "date", "4 de marzo de 2025"),
    ("Oggi è il 4 marzo 2025.", "date", "4 marzo 2025"),
    ("Hoje é 4 de março de 2025.", "date", "4 de março de 2025"),
    ("Vandaag is het 4 maart 2025.", "date", "4 maart 2025"),
    ("request req_8f3k2l9x0a started", "prefixed_id", "req_8f3k2l9x0a"),
    ("nonce=Zx81kQ0pLmN3vB7cX9qW2e", "base64_id", "Zx81kQ0pLmN3vB7cX9qW2e"),
    ("clock 9:05:06 now", "time", "9:05:06"),
]

NEGATIVE = [
    "You are a helpful assistant. Answer briefly.",
    "GPT-4 has many parameters; see page 12, step 3; H100 GPUs are fast.",
    "Python 3.11.10 and version v1.2.3 and IP 192.168.1.10 and ratio 16:9",
    "Call fetchWeatherForecastV2Async or OAuth2ClientCredentials3 or THIS_IS_A_CONSTANT_NAME_22.",
    "path /usr/lib/python3.11/site-packages/foo and 3.1415926535 and 12345",
    "phone +1 415-555-1234, 1,000,000 users, 99.9% uptime, 5 minutes",
    "already relocated: {{volatile:iso_datetime:1}} and {{volatile:uuid:12}}",
    # issue 9: static look-alikes the syntactic detectors used to rewrite
    "Use model gpt-4o-2024-08-06 or claude-3-5-sonnet-20241022 for this.",
    "Call us at 2125551234 any time.",
    "Account 1000000001 is the default; the limit is 2000000000 bytes.",
    "Office hours are 9:00-17:00, or 09:00 - 17:30 on Fridays.",
    "As John 3:16 says, and Genesis 1:1 too.",
    "Test card 4111111111111111 always succeeds.",
    "Use get_user2profile and list_items_v2 helpers.",
]


@pytest.mark.parametrize(("text", "rule", "value"), POSITIVE)
def test_detector_finds_value(text: str, rule: str, value: str) -> None:
    spans = SCANNER.scan(text)
    assert [(s.rule, text[s.start : s.end]) for s in spans] == [(rule, value)]


@pytest.mark.parametrize("text", NEGATIVE)
def test_no_false_positive(text: str) -> None:
    assert SCANNER.scan(text) == []


def test_every_detector_has_a_positive_example() -> None:
    assert {rule for _, rule, _ in POSITIVE} == set(DETECTORS)


def test_unix_timestamps_only_near_now_and_not_round() -> None:
    from gateway.prefix.volatile import _plausible_epoch

    now = 1_764_460_800  # 2025-11-30
    assert _plausible_epoch("1741064767", now) and _plausible_epoch("1741064767123", now)
    assert _plausible_epoch("1741064767.25", now)
    for value in ("2125551234", "1000000001", "2000000000", "1700000000000"):
        assert not _plausible_epoch(value, now), value


def test_card_numbers_are_not_ids_but_other_long_numbers_are() -> None:
    assert SCANNER.scan("card 4111111111111111") == []
    assert [s.rule for s in SCANNER.scan("id 4111111111111112")] == ["hex_id"]


def test_detectors_can_be_disabled() -> None:
    only_uuid = VolatileScanner(["uuid"])
    text = "2025-03-04T05:06:07Z 550e8400-e29b-41d4-a716-446655440000"
    assert [s.rule for s in only_uuid.scan(text)] == ["uuid"]
    assert VolatileScanner([]).empty


def test_custom_rule_and_priority_over_builtin() -> None:
    rules = [RegexRule(name="ticket", pattern=r"TICKET-\d+"), RegexRule(name="build", pattern=r"build \d{8}")]
    scanner = VolatileScanner(DETECTORS, rules)
    text = "Open TICKET-4711 on build 20250304 at 05:06."
    found = [(s.rule, text[s.start : s.end]) for s in scanner.scan(text)]
    assert found == [("ticket", "TICKET-4711"), ("build", "build 20250304"), ("time", "05:06")]


def test_custom_rule_ignore_case() -> None:
    scanner = VolatileScanner([], [RegexRule(name="nonce", pattern=r"nonce=\w+", ignore_case=True)])
    assert [s.rule for s in scanner.scan("NONCE=abc and nonce=def")] == ["nonce", "nonce"]


def test_limit_counts_starts_only() -> None:
    text = "x" * 10 + " 2025-03-04T05:06:07Z"
    assert SCANNER.scan(text, limit=12)[0].end == len(text)  # starts inside, may end outside
    assert SCANNER.scan(text, limit=11) == []


def test_placeholders_and_our_values_block_are_never_spans() -> None:
    block = values_block([f"{placeholder('iso_datetime', 1)} = 2025-03-04T05:06:07Z"])
    text = f"time {placeholder('iso_datetime', 1)} here\n\n{block}\nthen 2025-03-05"
    spans = SCANNER.scan(text)
    assert [(s.rule, text[s.start : s.end]) for s in spans] == [("date", "2025-03-05")]


def test_a_literal_values_block_in_the_input_is_plain_text() -> None:
    """Only a block whose checksum verifies is ours; a pasted or forged one is scanned like any text."""
    for fake in (
        f"{BLOCK_OPEN}>\n{placeholder('date', 1)} = 2025-03-04\n{BLOCK_CLOSE}",
        values_block(["{{volatile:date:1}} = 2025-03-04"]).replace("2025-03-04", "2025-03-05"),
    ):
        spans = SCANNER.scan(f"see {fake}")
        assert [s.rule for s in spans] == ["date"], fake


def test_id_longer_than_context_window_is_seen_whole() -> None:
    value = "ab" * 30 + "0123456789abcdef" * 3  # 108 hex chars, digits only far from the start
    text = "prefix " + value + " suffix"
    spans = SCANNER.scan(text)
    assert [text[s.start : s.end] for s in spans] == [value]


_filler = st.text(alphabet="abcdefghij klmnop,;!?", max_size=200)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(_filler, st.sampled_from(POSITIVE)), min_size=1, max_size=6), _filler)
def test_prefilter_equals_full_regex_scan(parts: list, tail: str) -> None:
    """The fast windowed scan finds exactly what one regex over the whole text finds."""
    text = "".join(f"{filler} {example[0]} " for filler, example in parts) + tail
    fast = [(s.start, s.end, s.rule) for s in SCANNER.scan(text)]
    rx = SCANNER._builtin
    assert rx is not None
    slow = []
    for m in rx.finditer(text):
        assert m.lastgroup is not None
        if accept_match(m.lastgroup, m.group()):
            slow.append((m.start(), m.end(), m.lastgroup))
    assert fast == slow
    for _, (_, rule, value) in parts:
        assert re.search(re.escape(value), text)
        assert any(text[a:b] == value and r == rule for a, b, r in fast)


def _full_scan(text: str) -> list[tuple[int, int, str | None]]:
    rx = SCANNER._builtin
    assert rx is not None
    return [(m.start(), m.end(), m.lastgroup) for m in rx.finditer(text) if accept_match(str(m.lastgroup), m.group())]


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="0123456789abcdefABCXYZ :-/.T+,_=\n", max_size=400))
def test_prefilter_equals_full_scan_on_digit_soup(text: str) -> None:
    assert [(s.start, s.end, s.rule) for s in SCANNER.scan(text)] == _full_scan(text)


_WORDS = st.sampled_from(
    [
        "the",
        "model",
        "Tue,",
        "04",
        "Mar",
        "2025",
        "05:06:07",
        "+0000",
        "March",
        "4,",
        "4th",
        "UTC",
        "-",
        "/",
        "2025-03-04",
        "T",
        "1717171717",
        "abc123DEF456ghi789JKL",
        "deadbeef",
        "0123456789abcdef01",
        "\n",
        "v2",
        "12",
    ]
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_WORDS, max_size=600), st.sampled_from([" ", "", "  "]))
def test_prefilter_equals_full_scan_on_long_word_soup(words: list[str], sep: str) -> None:
    text = sep.join(words)
    assert [(s.start, s.end, s.rule) for s in SCANNER.scan(text)] == _full_scan(text)
