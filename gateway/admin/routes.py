"""``/admin/*``: operator endpoints behind the admin key.

Off (404, OpenAI-shaped) when no admin key is configured; 401 for a missing or wrong key.
Endpoints get the ``Gateway`` through the :func:`require_admin` dependency and use only its
public methods (``stats_snapshot``, ``plan``, ...); report building lives in
:mod:`gateway.admin.explain`.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request

from gateway.admin.explain import explain, parse_input_bytes
from gateway.errors import NotFound, Unauthorized
from gateway.service import Gateway


def require_admin(request: Request) -> Gateway:
    """FastAPI dependency: the gateway, once the caller proved the admin key."""
    gateway: Gateway = request.app.state.gateway
    if not gateway.admin_keys.enabled:
        raise NotFound(
            "The admin API is disabled: set admin.api_key_sha256 in the config "
            f"or the {gateway.config.admin.api_key_env} environment variable.",
            code="admin_disabled",
        )
    if not gateway.admin_keys.check_authorization(request.headers.get("authorization")):
        raise Unauthorized("Incorrect or missing admin key: send 'Authorization: Bearer <admin key>'.")
    return gateway


router = APIRouter(prefix="/admin", tags=["admin"])

#: annotate an endpoint argument with this to require the admin key and get the gateway
AdminGateway = Annotated[Gateway, Depends(require_admin)]


@router.get("/stats")
async def admin_stats(gateway: AdminGateway) -> dict[str, Any]:
    """Per route and per replica: requests, tokens, hit rates (reported, predicted, engines), load, health."""
    return gateway.stats_snapshot()


@router.get("/samples")
async def admin_samples(gateway: AdminGateway) -> dict[str, Any]:
    """Recent request shapes (roles, lengths, keyed fingerprints, block-key chains; no prompt text
    unless ``samples.include_text``), for ``prefix-gateway doctor``.  404 while ``samples.enabled`` is off.
    """
    if gateway.samples is None:
        raise NotFound(
            "The sample buffer is off: set samples.enabled: true in the config (it records request shapes, "
            "not prompt text) and restart the gateway.",
            code="samples_disabled",
        )
    return gateway.samples.snapshot()


@router.post("/explain")
async def admin_explain(request: Request, gateway: AdminGateway) -> dict[str, Any]:
    """Where a request would go and why, without sending it: route, normalization diff, tokens,
    blocks, key, every replica's health/load/bound/match, the choice and its reason.

    Body: a chat/completions/embeddings request body (endpoint inferred from ``messages`` /
    ``prompt`` / ``input``) or ``{"endpoint": ..., "body": {...}, "headers": {...}}``.
    Changes no routing state.  Bad input → 400; unknown model → 404; no healthy replica → 503.
    """
    raw = await request.body()
    return explain(gateway, parse_input_bytes(raw, gateway.config.server.max_body_bytes))
