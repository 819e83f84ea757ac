"""A config reload that changes only a route's match list keeps what the route learned.

A timestamp at the top of a system prompt is moved after the stable prefix once the route has
seen its value change at that place (``normalize.always`` off, the default): one warm-up
request per template.  Adding a model name to the route's ``match`` must not bring that
warm-up back: the first request after the reload, with a fresh timestamp, is relocated at
once (``x-prefix-gateway-normalized``) and hits the cache on its stable prefix.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_helpers import ADMIN_KEY, MODEL, admin, ask, client, prefix_route, wait_for

from gateway.http.server import serve_in_thread
from gateway.sim.launcher import ReplicaGroup
from tests.configs import gateway_config

POLICY = "You are the booking desk of a theatre. Keep answers short and polite. " * 40


def stamped(second: int) -> list[dict[str, Any]]:
    system = {"role": "system", "content": f"Current time: 2025-03-04T17:05:{second:02d}Z.\n{POLICY}"}
    return [system, {"role": "user", "content": "Are there seats left for tonight?"}]


def write(path: Path, data: dict[str, Any]) -> None:
    """Replace the file (a new inode, as an editor or a ConfigMap swap does)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(data))
    os.replace(tmp, path)


def test_a_reload_that_changes_only_match_keeps_a_learned_volatile_place(
    fleet: ReplicaGroup, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PREFIX_GATEWAY_ADMIN_KEY", ADMIN_KEY)
    data = gateway_config(fleet.urls, routes=[prefix_route()]).model_dump(mode="json", exclude_unset=True)
    path = tmp_path / "gateway.yaml"
    write(path, data)
    with serve_in_thread(gateway_config([], **data), config_path=path, reload_poll_s=0.05) as gw:
        sdk = client(gw)
        assert "x-prefix-gateway-normalized" not in ask(sdk, stamped(1)).headers  # first sight: kept in place
        learned = ask(sdk, stamped(2))  # seen to change at its place: moved from now on
        assert learned.headers.get("x-prefix-gateway-normalized") == "iso_datetime=1"

        data["routes"][0]["match"] = {"models": [MODEL, "another-model"]}
        write(path, data)
        wait_for(lambda: gw.gateway.reloads["ok"] == 1, what="the reload")
        assert gw.gateway.routes.routes[0].config.match.models == [MODEL, "another-model"]

        after = ask(sdk, stamped(3))
        assert after.headers.get("x-prefix-gateway-normalized") == "iso_datetime=1"  # no warm-up again
        assert after.replica == learned.replica and after.cached_tokens and after.cached_tokens > 0
        with admin(gw) as api:
            stats = api.get("/admin/stats").json()["routes"]["main"]["normalization"]
        assert stats["learned"], stats  # the place is still listed as learned
