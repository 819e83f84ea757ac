"""Which rows a run has: the default set, --quick's lean set, the optional extra rows."""

from __future__ import annotations

from pathlib import Path

from benchmarks.bench_policies import DEFAULT_ROWS, SGLANG, Plan, Variant, gateway_config, parse_variant, variants_for
from benchmarks.workloads import Workload


def _names(workload: str, normalize: str = "off", **plan) -> list[str]:
    wl = Workload(name=workload, description="", requests=[], normalize=normalize)
    base = Plan(["moderate"], [*DEFAULT_ROWS, SGLANG], False, Path("."), **plan)
    return [v.name for v in variants_for(wl, base)]


def test_default_rows_are_what_the_verdicts_read_plus_round_robin():
    assert _names("agent_long") == ["round_robin", "least_loaded", "prefix", "sglang"]


def test_quick_keeps_least_loaded_for_the_control_and_sglang_elsewhere():
    assert _names("agent_long", lean=True) == ["round_robin", "prefix", "sglang"]
    assert _names("control", lean=True) == ["round_robin", "least_loaded", "prefix"]


def test_sglang_sees_prompts_unnormalized_and_norm_off_row_is_opt_in():
    wl = Workload(name="agent_toolloop", description="", requests=[], normalize="relocate")
    plan = Plan(["moderate"], ["prefix", SGLANG], False, Path("."), norm_off_row=True)
    rows = {v.name: v.normalize for v in variants_for(wl, plan)}
    assert rows == {"prefix": "relocate", "sglang": "off", "prefix_norm_off": "off"}
    assert "prefix_norm_off" not in _names("agent_toolloop", normalize="relocate")


def test_variant_rows_parse_settings_as_yaml_scalars():
    assert parse_variant("strict:prefix:bound_extra=0,load_factor=1.5") == (
        "strict",
        "prefix",
        (("bound_extra", 0), ("load_factor", 1.5)),
    )


def test_variant_health_keys_go_to_the_gateways_health_section():
    name, policy, settings = parse_variant("noslow:prefix:health.slow_ttft_factor=0,bound_extra=2")
    config = gateway_config([("r0", "http://127.0.0.1:1")], Variant(name, policy, "off", settings), 9)
    assert config["health"] == {"slow_ttft_factor": 0}
    assert config["routes"][0]["policy_settings"] == {"bound_extra": 2}
    plain = gateway_config([("r0", "http://127.0.0.1:1")], Variant("prefix", "prefix", "off"), 9)
    assert "health" not in plain and "policy_settings" not in plain["routes"][0]


def test_the_epp_row_is_opt_in_and_normalizes_as_the_proxy_row():
    from benchmarks.bench_policies import EPP

    assert EPP not in _names("agent", normalize="relocate")
    wl = Workload(name="agent", description="", requests=[], normalize="relocate")
    plan = Plan(["moderate"], ["prefix", SGLANG], False, Path("."), epp=True)
    rows = {v.name: (v.policy, v.normalize) for v in variants_for(wl, plan)}
    assert rows[EPP] == rows["prefix"] == ("prefix", "relocate")
    # without the prefix policy there is nothing to compare the picker with
    assert EPP not in [v.name for v in variants_for(wl, Plan(["moderate"], [SGLANG], False, Path("."), epp=True))]
