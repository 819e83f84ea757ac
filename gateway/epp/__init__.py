"""The endpoint picker: the gateway as Envoy's ``ext_proc`` server (Gateway API Inference Extension).

Envoy (Istio, kgateway, Envoy AI Gateway, GKE, or a standalone one: ``config/envoy/``) carries
the bytes; for each request it asks the picker which replica serves it.  The picker plans the
request exactly as ``prefix-gateway serve`` does — same config, routes, policies,
normalization, state backends, metrics — and answers with the pick.  docs/endpoint-picker.md.

    stream.py     one request's ext_proc state machine (no gRPC: tests drive it with messages)
    messages.py   the ProcessingResponse builders and readers (headers, metadata, body chunks, errors)
    endpoints.py  replicas as ``ip:port``
    server.py     the gRPC server (ext_proc + health) beside the HTTP metrics/admin app
    envoy_config.py  the standalone Envoy config, filled from its template

Its dependencies (grpcio, xds-protos, grpcio-health-checking) are the ``epp`` extra:
:func:`require_grpc` says so plainly when they are missing.
"""

from __future__ import annotations

INSTALL_HINT = "pip install 'prefix-gateway[epp]'"


def require_grpc() -> None:
    """Raise ``SystemExit`` naming the extra to install when the picker's packages are missing."""
    try:
        import envoy.service.ext_proc.v3.external_processor_pb2  # noqa: F401
        import grpc  # noqa: F401
        import grpc_health.v1.health  # noqa: F401
    except ImportError as exc:
        raise SystemExit(
            f"prefix-gateway epp needs the endpoint picker's packages (grpcio, xds-protos, "
            f"grpcio-health-checking), missing here ({exc.name or exc}): {INSTALL_HINT}"
        ) from None
