"""The virtual-clock replay: the real pipeline, policy runner and engine, deterministic and fast."""

from __future__ import annotations

import time

import pytest

from benchmarks import bench_virtual as bv
from benchmarks.workloads import build
from gateway.sim import engine as sim_engine


@pytest.fixture(scope="module")
def agent():
    return build("agent", size=0.1)


@pytest.mark.slow
def test_a_run_is_deterministic_and_every_request_finishes(agent):
    rows = bv.rows_for(agent, [("strict", "prefix", {"bound_extra": 0})], peers=True)
    first = bv.run_level(agent, "moderate", rows)
    second = bv.run_level(agent, "moderate", rows)
    for cells in (first, second):
        for stats in cells.values():
            stats.pop("seconds")
    assert first == second
    assert set(first) == {"prefix", "strict", "least_loaded", "sglang_like", "oracle"}
    assert all(cells["requests"] == len(agent.requests) for cells in first.values())
    assert sim_engine.time is time  # the engine's clock is given back


def test_prefix_routing_keeps_what_least_loaded_loses(agent):
    cells = bv.run_level(agent, "moderate", bv.rows_for(agent, [], peers=True))
    # the agent workload's timestamp header defeats every cache unless normalized (relocate)
    assert cells["prefix"]["hit_rate"] > 0.5
    assert cells["least_loaded"]["hit_rate"] < 0.1
    assert cells["prefix"]["hit_rate"] >= 0.9 * cells["oracle"]["hit_rate"]
    assert cells["prefix"]["decisions"].get("affinity", 0) > 0
    # what the gateway predicted, in the engines' units, is close to what they reported
    assert abs(cells["prefix"]["predicted_hit_rate"] - cells["prefix"]["hit_rate"]) < 0.05
    assert "predicted_hit_rate" not in cells["sglang_like"]


def test_the_gateway_hop_delays_what_the_client_sees(agent):
    rows = [row for row in bv.rows_for(agent, [], peers=False) if row[0] == "prefix"]
    plain = bv.run_level(agent, "moderate", rows)["prefix"]
    hop_ms = 5.0
    slow = bv.run_level(agent, "moderate", rows, hop_ms=hop_ms)["prefix"]
    hop_sim_ms = hop_ms / bv.bp.time_scale_for(agent, bv.bp.SIM, bv.bp.REPLICAS)
    # the request reaches its engine one hop later and its first token needs one more hop back
    assert slow["ttft_p50_ms"] > plain["ttft_p50_ms"] + hop_sim_ms


def test_closed_loop_sends_a_turn_only_after_the_one_it_resends():
    tenants = bv.arrivals_for(build("tenants", size=0.1), "saturated")
    linked = bv._next_in_session(tenants)
    # the chat tenant's turns wait for the reply they resend; a batch job's map steps do not
    assert linked and all(tenants[i][1].kind == "turn" for pair in linked.items() for i in pair)
    assert all(tenants[j][1].session == tenants[i][1].session for i, j in linked.items())
    wl = build("agent_long", size=0.1)
    rows = [row for row in bv.rows_for(wl, [], peers=False) if row[0] == "prefix"]
    fleet = bv.VirtualFleet([bv.sim_options(False) for _ in range(bv.bp.REPLICAS)])
    arrivals = bv.arrivals_for(wl, "saturated")
    opened = fleet.run(arrivals, rows[0][1]())
    fleet = bv.VirtualFleet([bv.sim_options(False) for _ in range(bv.bp.REPLICAS)])
    closed = fleet.run(arrivals, rows[0][1](), closed_loop=True)
    assert len(closed) == len(opened) == len(arrivals)
    pairs = bv._next_in_session(arrivals).items()
    assert len(pairs) > len(wl.requests) / 2  # every conversation's later turns

    def overlapping(outcomes: list[bv.Outcome]) -> int:  # turns sent before the one before answered
        return sum(outcomes[j].sent < outcomes[i].sent + outcomes[i].ttft for i, j in pairs)

    assert overlapping(opened) > 0 and overlapping(closed) == 0
    assert all(o.sent >= arrivals[k][0] for k, o in enumerate(closed))  # never earlier than the trace


def test_closed_loop_combines_with_flow_control():
    # flow control holds requests at the gateway and answers some itself (refused): a closed
    # loop's next turn still waits for the answer of the one it resends, whoever gave it
    wl = build("agent_long", size=0.1)
    rows = [row for row in bv.rows_for(wl, [], peers=False, flow=True) if row[0] == "prefix+flow"]
    fleet = bv.VirtualFleet([bv.sim_options(False) for _ in range(bv.bp.REPLICAS)])
    arrivals = bv.arrivals_for(wl, "saturated")
    closed = fleet.run(arrivals, rows[0][1](), closed_loop=True)
    assert len(closed) == len(arrivals)
    pairs = bv._next_in_session(arrivals).items()
    assert pairs and all(closed[j].sent >= closed[i].sent + closed[i].ttft for i, j in pairs)


def test_summary_reads_ratios_against_the_prefix_row_and_the_oracle():
    cell = {"hit_rate": 0.5, "ttft_p50_ms": 10.0, "ttft_p90_ms": 20.0, "alone_p90_ms": 5.0, "work_max_mean": 1.1}
    per_seed = [
        {"prefix": cell, "other": {**cell, "hit_rate": 0.45, "ttft_p90_ms": 40.0}, "oracle": {**cell, "hit_rate": 0.6}}
    ]
    summary = bv.relative_summary(per_seed)
    assert summary["other"]["hit_points_vs_prefix"]["mean"] == pytest.approx(-5.0)
    assert summary["other"]["hit_pct_oracle"]["mean"] == pytest.approx(75.0)
    assert summary["other"]["p90_x_prefix"]["mean"] == pytest.approx(2.0)
    assert summary["other"]["alone_p90_x_oracle"]["mean"] == pytest.approx(0.25)


def test_the_error_split_tells_what_the_engine_held_at_decision():
    def outcome(predicted: int, held: int, cached: int) -> bv.Outcome:
        return bv.Outcome(0, prompt_tokens=1000, cached_tokens=cached, held_at_decision=held, predicted=predicted)

    split = bv.error_split(
        [
            outcome(800, 500, 200),  # 300 gone before the decision, 300 evicted while queued
            outcome(100, 400, 700),  # 300 held and not credited, 300 stored by a sibling after
            outcome(500, 500, 500),  # exact
        ],
        3000,
    )
    assert split == pytest.approx({"gone": 0.1, "evicted": 0.1, "missed": 0.1, "arrived": 0.1})


def test_the_error_past_the_window_is_the_part_of_each_difference_beyond_it():
    def outcome(predicted: int, cached: int) -> bv.Outcome:
        return bv.Outcome(0, prompt_tokens=30_000, cached_tokens=cached, predicted=predicted)

    outcomes = [
        outcome(20_000, 12_000),  # all 8,000 past the window
        outcome(6_000, 1_000),  # 1,904 past it, 3,096 inside
        outcome(100, 300),  # all inside
    ]
    past = bv.error_past_window(outcomes, 90_000, window=4096)
    assert past == pytest.approx(9_904 / 90_000)
    total = sum(abs(o.predicted - o.cached_tokens) for o in outcomes)
    inside = sum(abs(min(o.predicted, 4096) - min(o.cached_tokens, 4096)) for o in outcomes)
    assert past * 90_000 + inside == pytest.approx(total)  # the two parts add up to the error
    assert bv.WINDOW_TOKENS == 4096  # the routes' default window, where the bench keys its rows


@pytest.mark.slow
def test_the_error_split_adds_up_to_the_prediction_error(agent):
    rows = [row for row in bv.rows_for(agent, [], peers=True, precise=True) if row[0] in ("precise", "sglang_like")]
    cells = bv.run_level(agent, "saturated", rows)
    precise = cells["precise"]
    assert precise["prediction_error"] > 0  # something to split
    assert sum(precise["error_split"].values()) == pytest.approx(precise["prediction_error"])
    assert 0 <= precise["prediction_error_past_window"] <= precise["prediction_error"]
    assert "error_split" not in cells["sglang_like"]  # a peer predicts nothing


def test_another_engine_block_size_keeps_each_cache_size_in_tokens(agent, monkeypatch):
    default = bv.sim_options(oracle=False)
    pooled = bv.sim_options(oracle=True)
    monkeypatch.setattr(bv, "ENGINE_BLOCK_SIZE", 128)
    cpu = bv.sim_options(oracle=False)
    assert (default.block_size, cpu.block_size) == (16, 128)
    assert cpu.num_gpu_blocks * 128 == default.num_gpu_blocks * 16
    assert bv.sim_options(oracle=True).num_gpu_blocks * 128 == pooled.num_gpu_blocks * 16
    # the routes follow the engines' size (as Gateway.plan does: the precise index matches only
    # keys at its engines' size), and predictions stay in the engines' units
    router = bv.GatewayRouter("prefix", agent.normalize, {}, bv.bp.REPLICAS, gateway_model=bv.ALIGNED_MODEL)
    req = agent.requests[0]
    view, _ = router._view(req, {**req.body, "model": bv.bp.MODEL}, {})
    assert view.block_size == 128
    cells = bv.run_level(agent, "moderate", [row for row in bv.rows_for(agent, [], peers=False) if row[0] == "prefix"])
    assert cells["prefix"]["hit_rate"] > 0.5
    assert abs(cells["prefix"]["predicted_hit_rate"] - cells["prefix"]["hit_rate"]) < 0.05


def test_alone_ttft_counts_one_engine_step_per_chunk_of_prefill():
    options = bv.sim_options(oracle=False)
    step = options.decode_ms_per_token / 1000.0
    assert bv.alone_ttft(0, options) == pytest.approx(step + 1 / options.prefill_tokens_per_s)
    big = options.max_num_batched_tokens * 2 + 1  # three chunks
    assert bv.alone_ttft(big, options) == pytest.approx(3 * step + big / options.prefill_tokens_per_s)


@pytest.mark.slow
def test_late_binding_rows_finish_everything_and_a_high_threshold_changes_nothing(agent):
    rows = bv.rows_for(agent, [], peers=False, hold=[1.0, 1e12, "1:1e12"])
    cells = bv.run_level(agent, "saturated", rows)
    never, always, calm = cells["prefix_hold1e+12"], cells["prefix_hold1"], cells["prefix_hold1_fleet1e+12"]
    for stats in (never, always, calm, cells["prefix"]):
        stats.pop("seconds")
    assert never == cells["prefix"]  # nothing is ever held
    assert calm == cells["prefix"]  # the fleet's queue never reaches the guard: nothing is held
    assert always["requests"] == len(agent.requests)  # held requests all leave in the end
    assert always != cells["prefix"]


@pytest.mark.slow
def test_salted_rings_are_other_instances_of_the_same_policy(agent):
    rows = bv.rows_for(agent, [], peers=False, salts=3)
    assert [name for name, _, _ in rows] == ["prefix", "prefix~1", "prefix~2", "oracle"]
    shipped, salted = rows[0][1](), rows[1][1]()
    keys = range(0, 2**64, 2**54)
    owners = [shipped.route_.runner.policy.ring.owner(k) for k in keys]
    assert owners != [salted.route_.runner.policy.ring.owner(k) for k in keys]  # another ring...
    assert owners == [rows[0][1]().route_.runner.policy.ring.owner(k) for k in keys]  # ...and the shipped one is back
    cells = bv.run_level(agent, "moderate", rows)
    assert all(stats["requests"] == len(agent.requests) for stats in cells.values())
    plain = bv.run_level(agent, "moderate", bv.rows_for(agent, [], peers=False))
    for stats in (cells["prefix"], plain["prefix"]):
        stats.pop("seconds")
    assert cells["prefix"] == plain["prefix"]  # salt 0 is the shipped policy


def test_ensemble_summary_spreads_and_compares_family_means():
    def cell(hit: float) -> dict[str, float]:
        return {"hit_rate": hit, "ttft_p90_ms": 20.0}

    oracle = {"hit_rate": 0.5, "ttft_p90_ms": 10.0}
    per_seed = [
        {"prefix": cell(0.45), "prefix~1": cell(0.55), "v": cell(0.5), "v~1": cell(0.6), "oracle": oracle},
        {"prefix": cell(0.5), "prefix~1": cell(0.5), "v": cell(0.5), "v~1": cell(0.5), "oracle": oracle},
    ]
    ensemble = bv.ensemble_summary(per_seed)
    assert set(ensemble) == {"prefix", "v"}
    prefix, v = ensemble["prefix"], ensemble["v"]
    assert prefix["instances"] == 2
    assert prefix["hit_pct_oracle"] == pytest.approx({"mean": 100.0, "min": 90.0, "max": 110.0})
    assert prefix["within_sample_sd"] == pytest.approx(5.0)  # (10 in the first sample, 0 in the second) / 2
    assert v["points_vs_prefix"] == pytest.approx({"mean": 2.5, "min": 0.0, "max": 5.0})
    assert v["p90_x_oracle"] == pytest.approx(2.0)


def test_the_flow_row_finishes_every_request_and_reports_each_tenant():
    tenants = build("tenants", size=0.6)
    # a lower saturation mark than shipped: the prefix policy keeps each batch job's burst on
    # one replica (until a spill pays for its recompute, spill_min_saving, not counting the job's
    # own queue), so at the default 16k queued tokens the route (every replica full) never
    # saturates at this size; at size 0.4 it did not even at 512 (one job's burst at a time)
    low = "low:saturation.queued_prefill_tokens=2048"
    rows = bv.rows_for(tenants, [], peers=False, flow=True, flow_variants=[low])
    cells = bv.run_level(tenants, "saturated", [row for row in rows if row[0] in ("prefix", "prefix+low")])
    flow, plain = cells["prefix+low"], cells["prefix"]
    for stats in (flow, plain):
        assert stats["requests"] + stats["refused"] == len(tenants.requests)
        assert stats["refused"] == 0  # nothing is sheddable and no TTL runs out here
        assert set(stats["tenants"]) == {"batch", "chat"}
        assert all(t["requests"] and t["ttft_p90_ms"] > 0 for t in stats["tenants"].values())
    # the fleet saturates during the bursts: some requests waited at the gateway, and left
    assert flow["flow"]["queued"] > 0 and flow["flow"]["wait_p90_ms"] > 0
    assert flow["flow"]["direct"] + flow["flow"]["queued"] == len(tenants.requests)
    assert "flow" not in plain


def test_a_flow_variant_also_gets_a_shipped_row_with_its_settings_when_every_default_is_on():
    wl = build("tenants", size=0.2)
    low = "low:saturation.queued_prefill_tokens=4096"
    names = [row[0] for row in bv.rows_for(wl, [], peers=False, flow=True, flow_variants=[low])]
    assert "prefix+low" in names and "shipped+low" not in names  # no events: no shipped row
    rows = {
        row[0]: row for row in bv.rows_for(wl, [], False, precise=True, project=True, flow=True, flow_variants=[low])
    }
    assert {"shipped", "shipped+low", "prefix+low"} <= set(rows)
    router = rows["shipped+low"][1]()
    assert router.flow.saturation.queued_prefill_tokens == 4096 and router.flow.enabled
    assert rows["shipped"][1]().flow.saturation.queued_prefill_tokens != 4096


def test_the_verdict_reads_medians_against_the_prefix_row():
    def cell(p50: float, p90: float, hit: float) -> dict[str, float]:
        return {"ttft_p50_ms": p50, "ttft_p90_ms": p90, "hit_rate": hit}

    per_seed = [
        {"prefix": cell(100, 200, 0.5), "prefix+flow": cell(100, 150, 0.5), "sglang_like": cell(100, 300, 0.5)}
        for _ in range(3)
    ]
    from benchmarks.virtual_flow import verdict

    saturated = verdict(per_seed, "saturated")["checks"]
    assert saturated["p90_vs_prefix"]["value"] == pytest.approx(0.75) and saturated["p90_vs_prefix"]["pass"]
    assert saturated["p90_vs_sglang_like"]["value"] == pytest.approx(0.5)
    assert saturated["hit_points_vs_prefix"]["pass"]
    assert verdict(per_seed, "moderate")["pass"]  # faster at moderate load is no cost
    slower = [{**cells, "prefix+flow": cell(104, 220, 0.5)} for cells in per_seed]
    moderate = verdict(slower, "moderate")
    assert moderate["checks"]["p50_vs_prefix"]["pass"] and not moderate["checks"]["p90_vs_prefix"]["pass"]
    assert not moderate["pass"]


def test_a_prompt_over_max_model_len_is_refused_as_the_engine_would(agent, monkeypatch):
    """The fleet hands requests straight to the engines, past the HTTP front where vLLM refuses
    a prompt over ``max_model_len`` (400). It checks that limit itself: such a request is
    counted refused, its replica is given back (no charge or in-flight left behind), and the
    session goes on. Before, a prompt larger than a tight cache stalled the engine for good."""
    prompts = sorted(r.prompt_tokens for r in agent.requests)
    limit = prompts[len(prompts) // 2]  # about half the prompts are over it
    over = sum(p > limit + 64 for p in prompts)  # the engine's tokens differ a little from the estimate
    monkeypatch.setitem(bv.bp.SIM, "max_model_len", limit)
    rows = [row for row in bv.rows_for(agent, [], peers=True) if row[0] in ("prefix", "sglang_like")]
    routers = []
    for i, (name, factory, oracle) in enumerate(rows):
        routers.append(factory())
        rows[i] = (name, lambda r=routers[-1]: r, oracle)
    cells = bv.run_level(agent, "moderate", rows)
    for stats in cells.values():
        assert stats["requests"] + stats["refused"] == len(agent.requests)
        assert stats["refused"] >= over > 0
    gateway = routers[0]
    assert all(r.in_flight == 0 and r.pending_prefill_tokens == 0 for r in gateway.pool)
    assert routers[1].load == [0] * len(routers[1].load)


def test_a_paired_comparison_says_how_far_its_median_can_be_trusted():
    """Few samples: the mean and the wins and losses, no interval; from SPREAD_MIN_SAMPLES on, a
    bootstrap interval of the median that holds the median, is the same on every run, and
    straddles zero where the rules trade wins."""
    few = bv.paired_spread([-0.01, 0.02, -0.005])
    assert few == {"samples": 3, "mean": pytest.approx(0.005 / 3), "wins": 1, "losses": 2}
    trading = [0.01, -0.01, 0.02, -0.005, 0.0, 0.03, -0.02, 0.004, -0.003, 0.015, -0.012, 0.006]
    spread = bv.paired_spread(trading)
    low, high = spread["median_ci95"]
    assert low < 0 < high
    assert low <= bv.statistics.median(trading) <= high
    assert bv.paired_spread(trading) == spread  # seeded: the same samples give the same interval
    winning = [0.01 + i / 1000 for i in range(12)]
    assert bv.paired_spread(winning)["median_ci95"][0] > 0

    def cells(d: float) -> dict[str, dict[str, float]]:
        rows = (("shipped", d), ("sglang_like", 0.0))
        return {row: {"hit_rate": 0.5 + x, "decision_state_error": 0.0} for row, x in rows}

    medians = bv.precise_medians([cells(d) for d in trading])
    got = medians["paired_spread"]["shipped-sglang_like"]  # (0.5 + d) - 0.5: d, within float noise
    assert got["wins"] == spread["wins"] and got["losses"] == spread["losses"]
    assert got["median_ci95"] == pytest.approx(spread["median_ci95"])


def test_first_seed_runs_the_samples_after_it(monkeypatch, tmp_path):
    """``--first-seed S --seeds N`` builds samples S..S+N-1 (more samples of a cell without
    running the first ones again) and says so in the JSON."""
    built: list[int] = []

    def fake_build(name, size, seed):
        built.append(seed)
        return build("agent", size=0.02, seed=seed)

    monkeypatch.setattr(bv, "build", fake_build)
    argv = ["--workload", "agent", "--load", "moderate", "--no-peers", "--seeds", "2", "--first-seed", "5"]
    assert bv.main([*argv, "--out", str(tmp_path)]) == 0
    assert built == [5, 6]
    assert bv.json.loads((tmp_path / "bench_virtual.json").read_text())["first_seed"] == 5
    with pytest.raises(SystemExit):
        bv.main(["--first-seed", "-1", "--out", str(tmp_path)])
