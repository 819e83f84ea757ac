"""Loading the configuration: validate a YAML file or a mapping into a :class:`GatewayConfig`.

Loading is two-phase, like uvicorn's ``Config``: :func:`load_config` / :func:`parse_config`
*validate* everything (types, cross references between routes and replicas, policy names
and each policy's own settings model) and raise one :class:`ConfigError` that names the
file, the field path and what is wrong; only then does ``gateway.service.Gateway`` *build*
components from the validated object.  The models themselves are :mod:`gateway.config.schema`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from gateway.config.errors import ConfigError
from gateway.config.schema import GatewayConfig


def _loc(parts: Sequence[Any]) -> str:
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _pydantic_problems(exc: ValidationError, prefix: Sequence[Any] = ()) -> list[tuple[str, str]]:
    problems = []
    for err in exc.errors():
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling; see docs/config.md)"
        problems.append((_loc([*prefix, *err["loc"]]), msg))
    return problems


def _check_routes(config: GatewayConfig) -> list[tuple[str, str]]:
    """Cross-checks pydantic cannot express locally: pool names and policy settings."""
    from gateway.routing import registry  # late import: the registry imports the policies

    problems: list[tuple[str, str]] = []
    names = {r.name for r in config.replicas} | {d.name for d in config.discovery}
    for i, route in enumerate(config.routes):
        for j, ref in enumerate(route.replicas or []):
            if ref not in names:
                problems.append(
                    (
                        f"routes[{i}].replicas[{j}]",
                        f"unknown replica {ref!r} (nor a discovery source); known: {sorted(names)}",
                    )
                )
        if route.replicas is not None and not route.replicas:
            problems.append((f"routes[{i}].replicas", "a route needs at least one replica"))
        if route.policy not in registry.POLICIES:
            valid = ", ".join(registry.policy_names())
            problems.append((f"routes[{i}].policy", f"unknown policy {route.policy!r}; valid policies: {valid}"))
            continue
        try:
            registry.validate_settings(route.policy, route.policy_settings)
        except ValidationError as exc:
            problems.extend(_pydantic_problems(exc, ("routes", i, "policy_settings")))
    return problems


def parse_config(data: Any, source: str = "<config>") -> GatewayConfig:
    """Phase one from a mapping: validate everything or raise :class:`ConfigError`."""
    if not isinstance(data, Mapping):
        raise ConfigError(source, [("", "the top level must be a mapping with at least `replicas:`")])
    try:
        config = GatewayConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(source, _pydantic_problems(exc)) from None
    problems = _check_routes(config)
    if problems:
        raise ConfigError(source, problems)
    return config


def load_config(path: str | os.PathLike[str]) -> GatewayConfig:
    """Phase one from a YAML file."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(source, [("", f"cannot read file: {exc.strerror or exc}")]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(source, [(where, f"invalid YAML: {problem}")]) from None
    return parse_config(data, source)


def quick_config(
    replica_urls: Sequence[str],
    policy: str = "prefix",
    host: str = "127.0.0.1",
    port: int = 8080,
    policy_settings: Mapping[str, Any] | None = None,
) -> GatewayConfig:
    """The config behind ``prefix-gateway serve --replica URL ... --policy NAME``."""
    data = {
        "server": {"host": host, "port": port},
        "replicas": [{"name": f"r{i}", "url": url} for i, url in enumerate(replica_urls)],
        "routes": [{"name": "default", "policy": policy, "policy_settings": dict(policy_settings or {})}],
    }
    return parse_config(data, "<command line>")


def packaged_default_config() -> Path:
    """``gateway/defaults/gateway.yaml``: the demo config, shipped inside the package."""
    return Path(__file__).parents[1] / "defaults" / "gateway.yaml"


def default_config_path() -> Path:
    """``./config/gateway.yaml`` when the working directory has one (an operator's), else the packaged default."""
    local = Path.cwd() / "config" / "gateway.yaml"
    return local if local.is_file() else packaged_default_config()
