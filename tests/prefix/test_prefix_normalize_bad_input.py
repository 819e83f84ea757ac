"""Normalization never raises on any JSON-valid body (issue 9: bad input)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.prefix.normalize import Normalizer
from gateway.prefix.settings import NormalizeSettings

_TEXT = st.one_of(
    st.text(max_size=40),
    st.sampled_from(
        ["2025-03-04T05:06:07Z", "{{volatile:date:1}}", "<volatile_values", "```", '{"a": 1}', "req_8f3k2l9x0a", ""]
    ),
)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _TEXT,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(_TEXT, children, max_size=4),
    max_leaves=12,
)
_CONTENT = st.one_of(
    _JSON,
    st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", 3]), "text": _JSON}), max_size=3),
)
_MESSAGE = st.one_of(
    _JSON,
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", None, 7]), "content": _CONTENT}
    ),
)
_BODY = st.fixed_dictionaries(
    {"model": st.just("m")},
    optional={
        "messages": st.one_of(_JSON, st.lists(_MESSAGE, max_size=5)),
        "tools": st.one_of(_JSON, st.lists(st.fixed_dictionaries({"function": _JSON}), max_size=3)),
        "prompt": st.one_of(_JSON, st.lists(_TEXT, max_size=3)),
    },
)
NORMALIZERS = [
    Normalizer(NormalizeSettings(mode="relocate")),
    Normalizer(NormalizeSettings(mode="relocate", always=["*"], roles=["system", "user"], canonicalize_tools=True)),
    Normalizer(NormalizeSettings(mode="report", detectors=[])),
]


@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
@given(_BODY)
@pytest.mark.slow
def test_normalization_never_raises(body: dict[str, Any]) -> None:
    for norm in NORMALIZERS:
        for endpoint in ("chat", "completions"):
            for _ in range(2):  # the second time, the learners have state
                result = norm.apply(endpoint, body)
                assert isinstance(result.body, dict)
