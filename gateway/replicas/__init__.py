"""The replica pool: per-replica state (health, in-flight, engine scrape) and its monitors."""

from gateway.replicas.engine import EngineStats, parse_engine_metrics
from gateway.replicas.monitor import ReplicaMonitor
from gateway.replicas.pool import Replica

__all__ = ["EngineStats", "Replica", "ReplicaMonitor", "parse_engine_metrics"]
