"""bench_warm_restart's pure parts: the workload (deterministic, Zipf-skewed, repeated prefixes),
the gateway config it runs (scaled clocks, warm-up on or off) and the window statistics."""

from __future__ import annotations

from collections import Counter

from benchmarks.bench_warm_restart import Spec, build_requests, gateway_config, window_stats
from benchmarks.replay import Outcome

SPEC = Spec(prefixes=8, prefix_tokens=50, rate=20.0, zipf=1.0, before_s=10.0, downtime_s=0.0, time_scale=0.5)


def test_workload_is_deterministic_skewed_and_repeats_its_prefixes() -> None:
    a, b = build_requests(SPEC), build_requests(SPEC)
    assert [(r.t, r.body) for r in a] == [(r.t, r.body) for r in b]
    assert all(0 < r.t < SPEC.span_s for r in a) and len(a) > SPEC.rate * SPEC.span_s * 0.7
    heads = Counter(r.body["messages"][0]["content"] for r in a)
    assert len(heads) == SPEC.prefixes  # every document comes back...
    counts = sorted(heads.values(), reverse=True)
    assert counts[0] > 3 * counts[-1]  # ...the popular ones far more often
    assert len({r.body["messages"][1]["content"] for r in a}) == len(a)  # each question is new


def test_gateway_config_scales_its_clocks_and_switches_warm_up() -> None:
    on, off = gateway_config(["http://a:1"], SPEC, True), gateway_config(["http://a:1"], SPEC, False)
    assert on["warm_restart"]["enabled"] and not off["warm_restart"]["enabled"]
    assert on["scrape"]["interval_s"] == 5.0 * SPEC.time_scale
    assert on["warm_restart"]["rate_per_s"] == 10.0 / SPEC.time_scale


def outcome(sent: float, ttft: float, replica: str, cached: int, prompt: int = 100) -> Outcome:
    return Outcome(
        0, sent, sent=sent, first_token=sent + ttft, done=sent + ttft, status=200, replica=replica,
        prompt_tokens=prompt, cached_tokens=cached,
    )  # fmt: skip


def test_window_stats_select_by_time_and_replica() -> None:
    outs = [outcome(0.5, 0.01, "r0", 90), outcome(1.5, 0.2, "r1", 0), outcome(1.6, 0.01, "r0", 90)]
    outs += [outcome(1.7 + i / 100, 0.02, "r0", 100) for i in range(7)]
    window = window_stats(outs, 1.0, 2.0)
    assert window["requests"] == 9 and window["cold_requests"] == 1
    assert abs(window["hit_rate"] - (90 + 700) / 900) < 1e-9
    assert abs(window["ttft_p50_ms"] - 20.0) < 1e-6 and window["ttft_p90_ms"] > 21.0
    one = window_stats(outs, 1.0, 2.0, replica="r1")
    assert one["requests"] == 1 and one["hit_rate"] == 0.0 and abs(one["ttft_p90_ms"] - 200.0) < 1e-6
