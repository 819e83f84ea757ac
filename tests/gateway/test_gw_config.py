"""Config: validation errors name the file, the field path and the problem; defaults; packaging."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import main
from gateway.config import (
    ConfigError,
    default_config_path,
    load_config,
    packaged_default_config,
    parse_config,
    quick_config,
    sha256_hex,
)

ROOT = Path(__file__).resolve().parents[2]
BASE = {"replicas": [{"name": "a", "url": "http://127.0.0.1:1"}, {"name": "b", "url": "http://127.0.0.1:2"}]}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gw.yaml"
    path.write_text(text)
    return path


def test_demo_config_and_examples_are_valid() -> None:
    for path in [packaged_default_config(), *sorted((ROOT / "config" / "examples").glob("*.yaml"))]:
        config = load_config(path)
        assert config.replicas, path


def test_one_default_config_the_packaged_one() -> None:
    """The demo config lives once, in the package (a copy under config/ drifted silently); an
    operator's ./config/gateway.yaml still wins when there is one."""
    assert not (ROOT / "config" / "gateway.yaml").exists()
    assert packaged_default_config().is_file()
    assert default_config_path() == packaged_default_config()  # run from the checkout: no local copy


def test_defaults_are_filled_in() -> None:
    config = parse_config(BASE)
    assert config.server.port == 8080
    assert config.health.interval_s == 5.0
    assert config.scrape.interval_s == 5.0
    assert config.logging.summary_interval_s == 10.0
    assert not config.logging.access_log_probes
    assert [r.name for r in config.routes] == ["default"]
    assert config.routes[0].policy == "prefix"
    assert config.pool_of(config.routes[0]) == config.replicas


def test_wrong_type_names_file_and_field(tmp_path: Path) -> None:
    path = write(tmp_path, "replicas:\n  - {name: a, url: 'http://x:1', weight: heavy}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert str(path) in message
    assert "replicas[0].weight" in message
    assert "number" in message


def test_unknown_field_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, "replicas: [{name: a, url: 'http://x:1'}]\nhealth: {intervall_s: 3}\n")
    with pytest.raises(ConfigError, match=r"health\.intervall_s: unknown field"):
        load_config(path)


def test_unknown_policy_lists_valid_ones() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, "routes": [{"name": "r", "policy": "fastest"}]}, "cfg.yaml")
    message = str(info.value)
    assert "cfg.yaml: routes[0].policy: unknown policy 'fastest'" in message
    for name in ("least_loaded", "random", "round_robin", "session"):
        assert name in message


def test_policy_settings_are_validated_by_the_policy_model() -> None:
    with pytest.raises(ConfigError, match=r"routes\[0\]\.policy_settings\.max_load_factor"):
        parse_config(
            {**BASE, "routes": [{"name": "r", "policy": "session", "policy_settings": {"max_load_factor": 0.5}}]}
        )
    with pytest.raises(ConfigError, match=r"routes\[0\]\.policy_settings\.bogus: unknown field"):
        parse_config({**BASE, "routes": [{"name": "r", "policy": "round_robin", "policy_settings": {"bogus": 1}}]})


def test_route_pool_must_name_known_replicas() -> None:
    with pytest.raises(ConfigError, match=r"routes\[0\]\.replicas\[1\]: unknown replica 'zz'"):
        parse_config({**BASE, "routes": [{"name": "r", "replicas": ["a", "zz"]}]})


def test_duplicate_names_and_bad_urls() -> None:
    with pytest.raises(ConfigError, match="duplicate name 'a'"):
        parse_config({"replicas": [{"name": "a", "url": "http://x:1"}, {"name": "a", "url": "http://x:2"}]})
    with pytest.raises(ConfigError, match=r"replicas\[0\]\.url: .*http://"):
        parse_config({"replicas": [{"name": "a", "url": "x:1"}]})


def test_prefix_sections_use_the_prefix_settings_models() -> None:
    config = parse_config(
        {**BASE, "routes": [{"name": "r", "normalize": {"mode": "off"}, "prefix": {"block_size": 32}}]}
    )
    assert config.routes[0].normalize.mode == "off"
    assert config.routes[0].prefix.block_size == 32
    with pytest.raises(ConfigError, match=r"routes\[0\]\.normalize\.mode"):
        parse_config({**BASE, "routes": [{"name": "r", "normalize": {"mode": "sometimes"}}]})


def test_yaml_syntax_error_names_line(tmp_path: Path) -> None:
    path = write(tmp_path, "replicas:\n  - name: a\n    url: [unclosed\n")
    with pytest.raises(ConfigError, match=r"line \d+, column \d+: invalid YAML"):
        load_config(path)


def test_missing_file_and_empty_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read file"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write(tmp_path, ""))


def test_admin_key_hash_must_be_sha256_hex_and_env_key_is_hashed() -> None:
    with pytest.raises(ConfigError, match=r"admin\.api_key_sha256"):
        parse_config({**BASE, "admin": {"api_key_sha256": "secret"}})
    config = parse_config({**BASE, "admin": {"api_key_sha256": sha256_hex("a")}})
    assert config.admin.key_hashes({"PREFIX_GATEWAY_ADMIN_KEY": "b"}) == [sha256_hex("a"), sha256_hex("b")]
    assert config.auth.key_hashes({"PREFIX_GATEWAY_API_KEYS": "k1, k2"}) == [sha256_hex("k1"), sha256_hex("k2")]


def test_quick_config() -> None:
    config = quick_config(["http://h:1", "http://h:2"], policy="round_robin", port=9000)
    assert [r.url for r in config.replicas] == ["http://h:1", "http://h:2"]
    assert config.routes[0].policy == "round_robin"
    assert config.server.port == 9000
    with pytest.raises(ConfigError, match="unknown policy"):
        quick_config(["http://h:1"], policy="nope")


def test_check_config_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = packaged_default_config()
    assert main(["check-config", str(good)]) == 0
    assert "OK" in capsys.readouterr().out
    bad = write(tmp_path, "replicas: [{name: a, url: 'http://x:1'}]\nroutes: [{name: r, policy: nope}]\n")
    assert main(["check-config", str(good), str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}: routes[0].policy: unknown policy 'nope'" in err
    assert "Traceback" not in err


def test_docs_config_reference_is_current() -> None:
    from gateway.config import BEGIN_MARK, END_MARK, markdown_reference

    text = (ROOT / "docs" / "config.md").read_text()
    generated = text[text.index(BEGIN_MARK) + len(BEGIN_MARK) : text.index(END_MARK)]
    assert generated == markdown_reference(), (
        "docs/config.md is out of date: run `python -m gateway.config --update docs/config.md`"
    )


def test_upstream_paths_start_with_a_slash_and_replica_urls_carry_no_path() -> None:
    with pytest.raises(ConfigError, match=r"health\.path: must start with '/'"):
        parse_config({**BASE, "health": {"path": "health"}})
    with pytest.raises(ConfigError, match=r"scrape\.path: must start with '/'"):
        parse_config({**BASE, "scrape": {"path": "metrics"}})
    with pytest.raises(ConfigError, match=r"replicas\[0\]\.url: .*without a path .*'/v1'"):
        parse_config({"replicas": [{"name": "a", "url": "http://127.0.0.1:1/v1"}]})
    assert parse_config({"replicas": [{"name": "a", "url": "http://127.0.0.1:1/"}]}).replicas[0].url == (
        "http://127.0.0.1:1"
    )
