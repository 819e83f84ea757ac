"""The ASGI application: endpoints only, no logic.

``/v1/chat/completions``, ``/v1/completions`` and ``/v1/embeddings`` are served by the raw
ASGI proxy (``gateway.proxy``) through a tiny path dispatcher in front of FastAPI — the hot
path skips FastAPI's routing and validation.  They are still declared in FastAPI (never
reached) so the OpenAPI document describes them.  Everything else — probes, metrics, models,
admin — is ordinary FastAPI.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.admin.routes import router as admin_router
from gateway.errors import GatewayError, NotFound, Unauthorized, error_bytes, status_error_body
from gateway.http.middleware import RequestContextMiddleware
from gateway.proxy.handler import ProxyEndpoint
from gateway.service import ENDPOINT_PATHS, Gateway

ASGIApp = Any


class FastPaths:
    """Dispatch the proxy paths straight to their handlers; everything else to FastAPI."""

    def __init__(self, handlers: dict[str, ProxyEndpoint], fallback: ASGIApp) -> None:
        self.handlers = handlers
        self.fallback = fallback

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            handler = self.handlers.get(scope["path"])
            if handler is not None:
                if scope["method"] == "POST":
                    await handler(scope, receive, send)
                else:
                    body = error_bytes(405, f"Method {scope['method']} not allowed; use POST")
                    await send(
                        {
                            "type": "http.response.start",
                            "status": 405,
                            "headers": [(b"content-type", b"application/json"), (b"allow", b"POST")],
                        }
                    )
                    await send({"type": "http.response.body", "body": body})
                return
        await self.fallback(scope, receive, send)


def _error_response(status: int, message: str, code: str | None = None) -> JSONResponse:
    return JSONResponse(status_error_body(status, message, code), status_code=status)


def build_fastapi(gateway: Gateway) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    expose = gateway.config.server.expose_openapi
    app = FastAPI(
        title="prefix-gateway",
        summary="Prefix-cache-aware OpenAI-compatible gateway for vLLM fleets",
        lifespan=lifespan,
        # closed unless configured (docs/security.md: what is public)
        openapi_url="/openapi.json" if expose else None,
        docs_url="/docs" if expose else None,
        redoc_url="/redoc" if expose else None,
    )
    app.state.gateway = gateway

    @app.exception_handler(GatewayError)
    async def _gateway_error(_: Request, exc: GatewayError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # Starlette still logs the traceback; the client gets OpenAI's shape, not plain text
        return _error_response(500, "internal gateway error", code="internal_error")

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return _error_response(400, f"{where}: {first['msg']}" if where else first["msg"], code="invalid_request")

    # -- probes and metrics ----------------------------------------------------------
    @app.get("/health", tags=["probes"])
    async def health() -> dict[str, str]:
        """Liveness: the process serves HTTP."""
        return {"status": "ok"}

    @app.get("/ready", tags=["probes"])
    async def ready() -> JSONResponse:
        """Readiness: every route has at least one healthy replica."""
        ok, detail = gateway.readiness()
        return JSONResponse({"status": "ready" if ok else "not ready", **detail}, status_code=200 if ok else 503)

    @app.get("/metrics", tags=["probes"])
    async def metrics() -> Response:
        """Prometheus exposition of ``prefix_gateway_*`` metrics."""
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # -- OpenAI API ------------------------------------------------------------------
    @app.get("/v1/models", tags=["openai"])
    async def models(request: Request) -> dict[str, Any]:
        """The union of the models that healthy replicas serve (and some route accepts)."""
        if gateway.client_keys.enabled and not gateway.client_keys.check_authorization(
            request.headers.get("authorization")
        ):
            raise Unauthorized("Incorrect or missing API key: send 'Authorization: Bearer <key>'.")
        return {"object": "list", "data": await gateway.models()}

    for endpoint, path in ENDPOINT_PATHS.items():
        _declare_proxy_path(app, endpoint, path)

    # -- admin -----------------------------------------------------------------------
    app.include_router(admin_router)

    return app


def _declare_proxy_path(app: FastAPI, endpoint: str, path: str) -> None:
    """Document a proxied path in OpenAPI; ``FastPaths`` answers it before FastAPI is reached."""

    async def proxied(request: Request) -> Response:  # pragma: no cover - shadowed by FastPaths
        raise NotFound("served by the proxy")

    proxied.__doc__ = f"OpenAI-compatible {endpoint} endpoint, proxied to a replica chosen by the route's policy."
    app.add_api_route(
        path,
        proxied,
        methods=["POST"],
        tags=["openai"],
        name=f"proxy_{endpoint}",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"type": "object", "required": ["model"]}}},
            }
        },
    )


def create_app(gateway: Gateway) -> ASGIApp:
    """The full ASGI app for ``gateway``: middleware → fast proxy paths → FastAPI."""
    api = build_fastapi(gateway)
    handlers = {path: ProxyEndpoint(gateway, endpoint) for endpoint, path in ENDPOINT_PATHS.items()}
    app = RequestContextMiddleware(
        FastPaths(handlers, api), gateway.access_log, gateway.config.server.request_id_header
    )
    app.api = api  # type: ignore[attr-defined]  # for extensions (e.g. /admin/explain) and tests
    app.gateway = gateway  # type: ignore[attr-defined]
    return app
