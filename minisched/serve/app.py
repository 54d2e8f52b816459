"""The FastAPI app: the routes (completions.py, chat.py hold the two generation routes; errors.py
the error bodies and the API key).

    app = create_app(engine, model_name="smollm2", api_key=None, limits=ServerLimits(max_queued_requests=64))

Routes: POST /v1/completions, POST /v1/chat/completions (both streaming with `stream: true`),
GET /v1/models, GET /v1/models/{id}, GET /health, GET /metrics, GET /debug/requests/{id} (debug.py); SGLang's native routes (POST
/generate, /server_info, /model_info, /get_load, /flush_cache, /health_generate: sglang_api.py).
Every response echoes the request's id in X-Request-Id (request_id.py). The engine thread
(`EngineLoop`) is started by the app's lifespan and stopped (what is left aborted) at its end.

Errors are OpenAI's body `{"error": {"message", "type", "param", "code"}}`: request
validation (malformed JSON, wrong types, out-of-range values, an invalid grammar) -> 400,
unknown model -> 404, a missing or wrong API key -> 401, a body over the limit -> 413 (limits.py),
queue full -> 429 + Retry-After,
shutting down -> 503, anything unexpected -> 500 with a one-line message (the traceback
goes to the log, never to the client). With an API key, every /v1 route, /generate and
/flush_cache need `Authorization: Bearer <key>`; /health, /metrics and SGLang's probes stay open (as in vLLM: probes and
scrapers; they show load, never request content -- bind to loopback or firewall them).
"""

from __future__ import annotations

import asyncio
import functools
from contextlib import asynccontextmanager
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from minisched.serve import protocol as p
from minisched.serve.chat import chat as chat_route
from minisched.serve.completions import completions as completions_route
from minisched.serve.debug import request_stories
from minisched.serve.engine_loop import EngineLoop
from minisched.serve.errors import BearerAuth, install_error_handlers
from minisched.serve.limits import ServerLimits
from minisched.serve.loop import ServingLoop
from minisched.serve.metrics import CONTENT_TYPE
from minisched.serve.request_body import BodyLimit, SafeJSONRoute
from minisched.serve.request_id import RequestIdMiddleware
from minisched.serve.sglang_api import install_sglang_routes
from minisched.serve.state import ServerState


def create_app(
    engine,
    *,
    model_name: str,
    api_key: Optional[str] = None,
    engine_loop: Optional[ServingLoop] = None,
    limits: ServerLimits = ServerLimits(),
) -> FastAPI:
    loop: ServingLoop = engine_loop or EngineLoop(engine)
    state = ServerState(engine, loop, model_name=model_name, api_key=api_key, limits=limits)
    for collector in loop.collectors():  # --dp: per-replica gauges
        state.metrics.registry.register(collector)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not loop.is_alive():
            loop.start()
        yield
        loop.stop()
        await asyncio.to_thread(loop.join, 10.0)

    # the error bodies in the schema
    errors: dict[int | str, dict[str, Any]] = {
        code: {"model": p.ErrorResponse} for code in (400, 401, 404, 413, 429, 500, 503)
    }
    app = FastAPI(title="minisched", lifespan=lifespan, docs_url=None, redoc_url=None, responses=errors)
    app.state.server = state
    app.router.route_class = SafeJSONRoute  # lone surrogates in a body become U+FFFD (request_body.py)
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=limits.max_request_body_bytes)  # 413 (the key is checked first)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    app.add_middleware(RequestIdMiddleware)  # outermost: a 401 echoes the id too

    @app.get("/health")
    async def health():
        h = loop.health()
        extra = h.as_json()
        if not h.alive:
            return JSONResponse({"status": "engine loop stopped", **extra}, status_code=503)
        if h.failure:  # --tp: a rank died or hung; every request fails from now on
            return JSONResponse({"status": h.failure, **extra}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining", **extra}, status_code=503)
        if h.degraded:
            return {"status": "degraded", **extra}  # still serving: 200, so a balancer keeps it
        return {"status": "ok", **extra}

    @app.get("/metrics", response_class=PlainTextResponse)  # the schema says text/plain (Prometheus text)
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> p.ModelList:
        return p.ModelList(data=[_card(state)])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> p.ModelCard:
        state.check_model(model_id)
        return _card(state)

    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, request: Request):
        return await completions_route(state, body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: p.ChatCompletionRequest, request: Request):
        return await chat_route(state, body, request)

    install_sglang_routes(app, state, loop)  # /generate, /server_info, /get_load, /flush_cache, ...

    @app.get("/debug/requests/{rid}")
    async def debug_request(rid: str):
        """Why a recent request waited and how it ran (debug.py), from every engine replica."""
        call_id = state.call_id_of(rid)
        futures = loop.call_all(functools.partial(request_stories, call_id))
        found = []
        for fut in futures:
            try:
                found += await asyncio.wrap_future(fut)
            except RuntimeError:  # a replica that is down holds nothing
                continue
        if not found:
            raise p.APIError(
                404, f"no recent request {rid!r} (the server keeps the last few thousand steps)", code="not_found"
            )
        return {"id": rid, "call_id": call_id, "requests": found}

    return app


# -- helpers -------------------------------------------------------------------------------------
def _card(state: ServerState) -> p.ModelCard:
    return p.ModelCard(id=state.model_name, created=state.created, max_model_len=state.max_context_len)
