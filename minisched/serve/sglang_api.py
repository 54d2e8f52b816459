"""SGLang's native routes, so that a `minisched serve` worker registers and is managed behind
sglang-router (`python -m sglang_router.launch_router --worker-urls ...`) as an SGLang worker is.

    install_sglang_routes(app, state, loop)     # create_app does this

What the router reads (sglang-router 0.3.2, `core/steps/worker/local/discover_metadata.rs`,
`core/worker_manager.rs`; docs/serving.md has the field table):

- GET /server_info (404 -> /get_server_info): `served_model_name` (the router's model id for
  the worker: /v1/models, a request's `model`), `dp_size`, `version`. No `model_path`: the router
  would try to load a tokenizer from it (a GGUF file is no tokenizer it can read). SGLang's
  limits are here too, under SGLang's names, for SGLang's clients and for people, and the model's
  own `chat_template` (SGLang's field of that name is an override's name).
- GET /model_info (404 -> /get_model_info): `model_type`, `architectures` (the model's family, e.g.
  qwen2 / Qwen2ForCausalLM; labels for the router); SGLang's clients read `model_path` (here the
  served name) and `is_generation`.
- GET /get_load: `[{"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}]`, one row per
  engine replica; the router sums `num_tokens` (its `power_of_two` policy and `/get_loads`).
- POST /flush_cache (GET too, as SGLang): every replica's radix cache and, with --dp, the
  in-process router's trees; 200 when done (the router counts any 2xx as flushed).
- GET /health_generate: one greedy token through the engine; 200, or 503 when none came.
- POST /generate: generate.py.

/health stays the route the router probes by default (`--health-check-endpoint /health`).
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from minisched.model.families import hf_architecture
from minisched.sched.sampling_params import SamplingParams
from minisched.serve.generate import generate, sglang_error
from minisched.serve.loop import ServingLoop
from minisched.serve.protocol import APIError
from minisched.serve.sglang_protocol import SGLangError
from minisched.serve.state import Prepared, ServerState

log = logging.getLogger("minisched.serve")
HEALTH_GENERATE_TIMEOUT = 20.0  # seconds, SGLang's SGLANG_HEALTH_CHECK_TIMEOUT default
FLUSH_TIMEOUT = 60.0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("minisched")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


def server_info(state: ServerState, loop: ServingLoop) -> dict:
    cfg = state.sched_config
    return {
        "served_model_name": state.model_name,
        "dp_size": len(loop.replica_stats()),
        "version": _version(),
        "context_length": cfg.max_context_len,
        "page_size": cfg.page_size,
        "max_total_num_tokens": cfg.num_pages * cfg.page_size,  # per replica
        "max_running_requests": cfg.max_running_requests,
        "max_prefill_tokens": cfg.max_prefill_tokens,
        "chunked_prefill_size": cfg.chunk_size if cfg.chunk_size is not None else -1,
        "max_queued_requests": state.limits.max_queued_requests,
        "schedule_policy": cfg.policy,
        "disable_radix_cache": not cfg.enable_radix_cache,
        "chat_template": state.tokenizer.chat_template,  # the model's own (SGLang's field names an override)
    }


def model_info(state: ServerState) -> dict:
    return {
        "model_path": state.model_name,
        "tokenizer_path": None,
        "is_generation": True,
        "model_type": state.model_config.architecture,
        "architectures": [hf_architecture(state.model_config.architecture)],
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
    }


def loads(state: ServerState, loop: ServingLoop) -> list[dict]:
    """SGLang's /get_load rows; num_tokens: KV tokens live requests hold (cache-only pages not counted)."""
    page = state.sched_config.page_size
    return [
        {
            "dp_rank": i,
            "num_reqs": st.running + st.waiting,
            "num_waiting_reqs": st.waiting,
            "num_tokens": max(0, st.pages_total - st.pages_free - st.pages_evictable) * page,
        }
        for i, st in enumerate(loop.replica_stats())
    ]


async def health_generate(state: ServerState) -> bool:
    """One greedy token from prompt [0] (SGLang's probe) within HEALTH_GENERATE_TIMEOUT."""
    call = state.admit([Prepared([0], SamplingParams(max_new_tokens=1))], "health")

    async def first():
        async for _, upd in call.updates():
            return upd

    try:
        upd = await asyncio.wait_for(first(), HEALTH_GENERATE_TIMEOUT)
    except asyncio.TimeoutError:
        log.error("health_generate: no token in %.0f s", HEALTH_GENERATE_TIMEOUT)
        return False
    finally:
        call.abort_unfinished()
    return upd.finish_reason not in ("error", "abort")


# SGLang's routes answer errors in SGLang's shape, not OpenAI's (the app's default in the schema)
SGLANG_ERRORS: dict = {code: {"model": SGLangError} for code in (400, 429, 500, 503)}  # 413: the body limit, OpenAI's


def install_sglang_routes(app: FastAPI, state: ServerState, loop: ServingLoop) -> None:
    @app.get("/server_info")
    @app.get("/get_server_info")
    async def _server_info():
        return server_info(state, loop)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def _model_info():
        return model_info(state)

    @app.get("/get_load")
    async def _get_load():
        return loads(state, loop)

    async def _flush_cache():
        if not loop.is_alive():
            return PlainTextResponse("Cache not flushed: the engine is not running.\n", status_code=503)
        freed = await asyncio.to_thread(loop.flush_cache, FLUSH_TIMEOUT)
        log.info("flush_cache: %d KV pages freed", freed)
        return PlainTextResponse(f"Cache flushed: {freed} KV pages freed.\n")

    for method in ("GET", "POST"):  # one operation per method, each with its own id (the OpenAPI schema)
        app.add_api_route(
            "/flush_cache",
            _flush_cache,
            methods=[method],
            response_class=PlainTextResponse,
            operation_id=f"flush_cache_{method.lower()}",
        )

    @app.get("/health_generate", responses={503: {"model": SGLangError}})
    async def _health_generate():
        try:
            ok = await health_generate(state)
        except APIError as exc:  # draining, engine down, queue full
            return sglang_error(503, exc.info.message)
        return JSONResponse({}, status_code=200) if ok else sglang_error(503, "the engine produced no token")

    async def _generate(request: Request):
        return await generate(state, request)

    for method in ("POST", "PUT"):
        app.add_api_route(
            "/generate",
            _generate,
            methods=[method],
            operation_id=f"generate_{method.lower()}",
            responses=SGLANG_ERRORS,
        )
