"""The OpenAI-compatible HTTP server: `create_app(engine, settings)` -> FastAPI.

    app = create_app(lambda: Engine(config), ServerSettings(model_name="qwen", api_key="sk-..."))
    uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints: POST /v1/chat/completions, POST /v1/completions (streaming over SSE or not),
POST /tokenize and /detokenize (vLLM's), GET /v1/models, GET /health (503 until the model is loaded, or once the engine loop died),
GET /metrics (Prometheus), GET / (a chat page that colors tokens by origin).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from specdec.api.anthropic import router as anthropic_router
from specdec.api.completions import router as completions_router
from specdec.api.responses import router as responses_router
from specdec.api.engine_loop import AsyncEngine
from specdec.api.errors import install_error_handlers
from specdec.api.middleware import ApiKeyMiddleware, BodyLimitMiddleware, IgnoredFieldsHeader
from specdec.api.state import ServerSettings, ServerState, server_state
from specdec.api.tokenize import router as tokenize_router
from specdec.version import version

PAGE = Path(__file__).parent / "static" / "index.html"


def create_app(engine: Any | Callable[[], Any] | AsyncEngine, settings: ServerSettings | None = None) -> FastAPI:
    """An app serving `engine`: an Engine, a factory that builds one (run on the engine thread, so
    /health answers 503 while it loads, then while it warms up if `settings.warmup`), an
    AsyncEngine, or a `cluster.client.ReplicaEngine` (engine replicas on Ray Serve; then GET
    /cluster shows the router's view of them)."""
    settings = settings or ServerSettings()
    if not hasattr(engine, "submit_all"):  # an Engine or a factory; AsyncEngine and ReplicaEngine pass
        from specdec.warmup import warm_up

        engine = AsyncEngine(engine, on_load_error=settings.on_load_error,
                             warmup=warm_up if settings.warmup else None)
    state = ServerState(settings, engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(
        title="specdec", version=version(), lifespan=lifespan,
        description="OpenAI-compatible server over a speculative-decoding engine.",
    )
    app.state.specdec = state
    install_error_handlers(app, state.metrics.record_status)
    # Added last = outermost: the key is checked before the body is read.
    app.add_middleware(IgnoredFieldsHeader)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes, on_reject=state.metrics.record_status)
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key, on_reject=state.metrics.record_status)
    app.include_router(completions_router)
    app.include_router(anthropic_router)
    app.include_router(responses_router)
    app.include_router(tokenize_router)
    _add_service_routes(app, state)
    app.openapi = _openapi_without_422(app)
    return app


def _openapi_without_422(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """FastAPI documents validation errors as 422; this server answers them with 400."""
    original = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = original()
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
        return app.openapi_schema

    return openapi


def _add_service_routes(app: FastAPI, state: ServerState) -> None:
    started = int(time.time())

    @app.get("/health", tags=["service"])
    async def health() -> JSONResponse:
        engine = state.engine
        if engine.error is not None:
            return JSONResponse({"status": "error", "error": engine.error}, status_code=503)
        if engine.info is None:
            return JSONResponse({"status": engine.phase}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", tags=["service"])
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict[str, Any]:
        card = {"id": state.settings.model_name, "object": "model", "created": started, "owned_by": "specdec",
                "specdec_version": version()}
        if state.engine.info is not None:
            card["max_model_len"] = state.engine.info.max_model_len
        return card

    if hasattr(state.engine, "cluster_status"):
        @app.get("/cluster", tags=["service"])
        async def cluster() -> dict[str, Any]:
            """The engine replicas as the router sees them, and its counters."""
            return state.engine.cluster_status()

    @app.get("/version", tags=["service"])
    async def server_version() -> dict[str, str]:
        return {"version": version()}

    @app.get("/v1/models", tags=["openai"])
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}", tags=["openai"])
    async def get_model(model: str, request: Request) -> dict[str, Any]:
        server_state(request).check_model(model)
        return model_card()

    @app.get("/", include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(PAGE.read_text(encoding="utf-8"))
