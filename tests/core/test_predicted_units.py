"""Predicted hit rate says what it is counted in: exact model tokens, or an approximation."""

from __future__ import annotations

from gateway.observe.metrics import GatewayMetrics
from gateway.observe.outcome import Outcome
from gateway.observe.stats import StatsBook


def outcome(units: str | None, predicted: int = 50, prompt: int = 100, cached: int | None = 40) -> Outcome:
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


def test_the_prediction_error_counts_each_miss_however_the_others_go() -> None:
    """Over- and under-predictions cancel in hit_rate_gap; the error adds them up (what issue 23's
    bar measures: mean |predicted - reported| per prompt token)."""
    book = StatsBook()
    metrics = GatewayMetrics()
    for o in (outcome("exact (llama3)", predicted=60, cached=40), outcome("exact (llama3)", predicted=20, cached=40)):
        book.record(o)
        metrics.record(o)
    metrics.record(Outcome(route="r", endpoint="chat", status=200, replica="a", prompt_tokens=100, cached_tokens=0))
    d = book.by_route["r"].as_dict()
    assert d["hit_rate_gap"] == 0.0  # 80 predicted, 80 reported: the gap hides both misses
    assert (d["prediction_over_tokens"], d["prediction_under_tokens"]) == (20, 20)
    assert d["prediction_error"] == 0.2  # 40 tokens off over 200 prompt tokens
    sample = metrics.registry.get_sample_value
    for direction in ("over", "under"):
        labels = {"route": "r", "replica": "a", "direction": direction}
        assert sample("prefix_gateway_prediction_error_tokens_total", labels) == 20
    # the request with no prediction is not checked
    assert sample("prefix_gateway_prediction_checked_prompt_tokens_total", {"route": "r", "replica": "a"}) == 200


def test_no_reported_cached_tokens_no_prediction_error() -> None:
    book = StatsBook()
    book.record(outcome("exact (llama3)", cached=None))
    d = book.by_route["r"].as_dict()
    assert d["prediction_error"] is None and d["hit_rate_predicted"] == 0.5
