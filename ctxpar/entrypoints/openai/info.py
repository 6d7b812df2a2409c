"""The routes that describe the server: GET /health (health.py's report),
GET /metrics (Prometheus, server_metrics.py) and GET /v1/models (the one model served)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from ctxpar.entrypoints.openai import health as H
from ctxpar.entrypoints.openai import responses as R
from ctxpar.entrypoints.openai.state import ServerDep

router = APIRouter()


@router.get("/health")
async def health(request: Request, state: ServerDep) -> Response:
    status, body = H.report(state.engine_client, state.admission, state.access.authorized(request.scope))
    return JSONResponse(body, status_code=status)


@router.get("/metrics")
async def metrics(request: Request, state: ServerDep) -> Response:
    private = state.access.authorized(request.scope)  # with --public-metrics, a scraper may have no key
    return Response(state.metrics.render(private), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(state: ServerDep) -> dict:
    card_created = R.now()
    card = {
        "id": state.model_name,
        "object": "model",
        "created": card_created,
        "owned_by": "ctxpar",
        "root": state.engine.loaded.name,
        "parent": None,
        "max_model_len": state.engine.max_model_len,
        "permission": [_permission(card_created)],  # vLLM's card has one; clients written for it may read it
    }
    return {"object": "list", "data": [card]}


def _permission(created: int) -> dict:
    """vLLM's ModelPermission of a served model: sampling and logprobs allowed, nothing else."""
    return {
        "id": f"modelperm-{created}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
