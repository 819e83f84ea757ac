"""Predicted hit rate says what it is counted in: exact model tokens, or an approximation."""

from __future__ import annotations

from gateway.observe.outcome import Outcome
from gateway.observe.stats import StatsBook


def outcome(units: str | None, predicted: int = 50, prompt: int = 100, cached: int = 40) -> Outcome:
    return Outcome(
        route="r",
        endpoint="chat",
        status=200,
        replica="a",
        prompt_tokens=prompt,
        cached_tokens=cached,
        predicted_cached_tokens=predicted,
        predicted_units=units,
    )


def test_exact_predictions_are_labelled_exact() -> None:
    book = StatsBook()
    book.record(outcome("exact (llama3)"))
    d = book.by_route["r"].as_dict()
    assert d["predicted_units"] == "exact (llama3)" and d["predicted_exact"] is True
    assert d["hit_rate_predicted"] == 0.5 and d["hit_rate_gap"] == 0.1


def test_fallback_vocabulary_is_labelled_approximate_and_mixing_is_visible() -> None:
    book = StatsBook()
    book.record(outcome("approximate (cl100k_base)"))
    d = book.by_route["r"].as_dict()
    assert d["predicted_units"] == "approximate (cl100k_base)" and d["predicted_exact"] is False
    book.record(outcome("exact (qwen3)"))
    d = book.by_route["r"].as_dict()
    assert d["predicted_units"] == "mixed: approximate (cl100k_base), exact (qwen3)"
    assert d["predicted_exact"] is False


def test_no_prediction_no_label() -> None:
    book = StatsBook()
    book.record(Outcome(route="r", endpoint="chat", status=200, prompt_tokens=10))
    d = book.by_route["r"].as_dict()
    assert d["predicted_units"] is None and d["predicted_exact"] is None and d["hit_rate_gap"] is None
