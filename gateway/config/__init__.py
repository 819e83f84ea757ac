"""The gateway's configuration: its schema, loading, and the lifecycle around a running config.

Importers use this package's names (``from gateway.config import GatewayConfig``); the
modules behind it each have one job (see the package listing).
"""

from gateway.config.errors import ConfigError
from gateway.config.loading import (
    default_config_path,
    load_config,
    packaged_default_config,
    parse_config,
    quick_config,
)
from gateway.config.reference import BEGIN_MARK, END_MARK, markdown_reference
from gateway.config.schema import (
    DEFAULT_ADMIN_KEY_ENV,
    GatewayConfig,
    HealthSettings,
    LoggingSettings,
    ReplicaConfig,
    RouteConfig,
    SampleSettings,
    ScrapeSettings,
    UpstreamSettings,
    WarmRestartSettings,
    sha256_hex,
)

__all__ = [
    "BEGIN_MARK",
    "DEFAULT_ADMIN_KEY_ENV",
    "END_MARK",
    "ConfigError",
    "GatewayConfig",
    "HealthSettings",
    "LoggingSettings",
    "ReplicaConfig",
    "RouteConfig",
    "SampleSettings",
    "ScrapeSettings",
    "UpstreamSettings",
    "WarmRestartSettings",
    "default_config_path",
    "load_config",
    "markdown_reference",
    "packaged_default_config",
    "parse_config",
    "quick_config",
    "sha256_hex",
]
