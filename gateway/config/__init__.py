"""The gateway's configuration: its schema, loading, and the lifecycle around a running config.

Importers use this package's names (``from gateway.config import GatewayConfig``); behind it,
one job a module: ``schema`` (the pydantic models), ``loading`` (parse, load, quick start,
default paths), ``reference`` (docs/config.md's generated table), ``errors`` (ConfigError) and
``reload`` (watching the file and applying it live).
"""

from gateway.config.errors import ConfigError
from gateway.config.loading import (
    default_config_path,
    load_config,
    packaged_default_config,
    parse_config,
    quick_config,
)
from gateway.config.reference import BEGIN_MARK, END_MARK, markdown_reference, update_reference
from gateway.config.schema import (
    DEFAULT_ADMIN_KEY_ENV,
    DEFAULT_API_KEYS_ENV,
    ENDPOINTS,
    AdminSettings,
    AuthSettings,
    GatewayConfig,
    HeaderMatch,
    HealthSettings,
    LimitsSettings,
    LoggingSettings,
    ReplicaConfig,
    RouteConfig,
    RouteMatch,
    SampleSettings,
    ScrapeSettings,
    ServerSettings,
    StateSettings,
    UpstreamSettings,
    WarmRestartSettings,
    sha256_hex,
)
from gateway.discovery.settings import DiscoveryConfig
from gateway.prefix.settings import NormalizeSettings, PrefixSettings

__all__ = [
    "BEGIN_MARK",
    "DEFAULT_ADMIN_KEY_ENV",
    "DEFAULT_API_KEYS_ENV",
    "ENDPOINTS",
    "END_MARK",
    "AdminSettings",
    "AuthSettings",
    "ConfigError",
    "DiscoveryConfig",
    "GatewayConfig",
    "HeaderMatch",
    "HealthSettings",
    "LimitsSettings",
    "LoggingSettings",
    "NormalizeSettings",
    "PrefixSettings",
    "ReplicaConfig",
    "RouteConfig",
    "RouteMatch",
    "SampleSettings",
    "ScrapeSettings",
    "ServerSettings",
    "StateSettings",
    "UpstreamSettings",
    "WarmRestartSettings",
    "default_config_path",
    "load_config",
    "markdown_reference",
    "packaged_default_config",
    "parse_config",
    "quick_config",
    "sha256_hex",
    "update_reference",
]
