"""Config schema of discovery sources (``discovery:`` in gateway.yaml).

Each source is named; a route lists the name in ``replicas:`` like a replica's, and gets
every replica that source currently reports (combinable with static replicas).  Kept out of
``gateway.config`` so the discovery package owns its settings; ``gateway.config`` embeds them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
KINDS = ("dns", "kubernetes", "inference_pool")  # the source kinds, one key each in a source


class _Strict(BaseModel):
    model_config = {"extra": "forbid"}


class DnsSettings(_Strict):
    """Resolve a name's A/AAAA records on an interval: a Kubernetes headless Service's pod IPs."""

    host: str = Field(..., min_length=1, description="name to resolve, e.g. vllm.default.svc.cluster.local")
    port: int = Field(8000, ge=1, le=65535, description="port of every resolved address")
    scheme: Literal["http", "https"] = Field("http", description="scheme of the replica URLs")
    interval_s: float = Field(5.0, gt=0, description="how often the name is resolved again")


class KubeApiSettings(_Strict):
    """How to reach the API server (shared by the EndpointSlice and InferencePool sources)."""

    namespace: str | None = Field(None, description="namespace to watch (default: the gateway pod's own)")
    scheme: Literal["http", "https"] = Field("http", description="scheme of the replica URLs")
    api_url: str | None = Field(
        None, description="API server URL (default: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT)"
    )
    service_account_dir: str = Field(
        SERVICE_ACCOUNT_DIR, description="where the pod's token, ca.crt and namespace files are mounted"
    )
    resync_s: float = Field(300.0, gt=0, description="list everything again this often (watches can miss events)")
    watch_timeout_s: int = Field(240, ge=1, description="server-side timeout of one watch request")

    @field_validator("api_url")
    @classmethod
    def _api_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return value.rstrip("/") if value else value


class KubernetesSettings(KubeApiSettings):
    """List + watch EndpointSlices through the API server with the pod's service account."""

    label_selector: str = Field(
        ...,
        min_length=1,
        description="EndpointSlice label selector, e.g. kubernetes.io/service-name=vllm (the Service's name)",
    )
    port_name: str | None = Field(None, description="the EndpointSlice port to use, by name (default: the first)")
    port: int | None = Field(None, ge=1, le=65535, description="use this port instead of the slice's")


class InferencePoolSettings(KubeApiSettings):
    """List + watch one ``inference.networking.k8s.io/v1`` InferencePool, then the pods it selects.

    Every ready pod matching the pool's ``spec.selector.matchLabels`` is one replica per
    ``spec.targetPorts`` entry (``podIP:number``), as the Gateway API Inference Extension's own
    endpoint picker counts them.
    """

    name: str = Field(
        ...,
        min_length=1,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="the InferencePool's metadata.name (in `namespace`)",
    )


class DiscoveryConfig(_Strict):
    """One named replica source; exactly one of ``dns`` / ``kubernetes`` / ``inference_pool``."""

    name: str = Field(
        ..., min_length=1, max_length=32, description="routes list it in replicas:; prefix of discovered names"
    )
    dns: DnsSettings | None = Field(None, description="resolve a (headless Service) name")
    kubernetes: KubernetesSettings | None = Field(None, description="watch EndpointSlices")
    inference_pool: InferencePoolSettings | None = Field(
        None, description="watch a Gateway API Inference Extension InferencePool and its pods"
    )
    weight: float = Field(1.0, gt=0, description="weight of every discovered replica")
    api_key_env: str | None = Field(None, description="env var with the upstream API key of discovered replicas")
    drain_timeout_s: float = Field(
        600.0,
        ge=0,
        description="a replica that leaves gets no new requests; its running ones get this long before "
        "its connections are closed",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not all(c.isalnum() or c in "-_." for c in value):
            raise ValueError("use letters, digits, '-', '_' or '.' only")
        return value

    @model_validator(mode="after")
    def _one_kind(self) -> DiscoveryConfig:
        kinds = [kind for kind in KINDS if getattr(self, kind) is not None]
        if len(kinds) != 1:
            raise ValueError("set exactly one of " + ", ".join(f"`{kind}`" for kind in KINDS))
        return self

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) is not None)
