"""The FastAPI app: OpenAI routes, error bodies, the API key, streaming out.

    app = create_app(engine, model_name="smollm2", api_key=None, max_queued_requests=512)

Routes: POST /v1/completions, POST /v1/chat/completions (both streaming with `stream: true`),
GET /v1/models, GET /v1/models/{id}, GET /health, GET /metrics. The engine thread
(`EngineLoop`) is started by the app's lifespan and stopped (what is left aborted) at its end.

Errors are OpenAI's body `{"error": {"message", "type", "param", "code"}}`: request
validation (malformed JSON, wrong types, unknown fields, out-of-range values) -> 400,
unknown model -> 404, a missing or wrong API key -> 401, queue full -> 429 + Retry-After,
shutting down -> 503, anything unexpected -> 500 with a one-line message (the traceback
goes to the log, never to the client). With an API key, every /v1 route needs
`Authorization: Bearer <key>`; /health and /metrics stay open (as in vLLM: probes and
scrapers; they show load, never request content -- bind to loopback or firewall them).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from contextlib import asynccontextmanager
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minisched.model.detokenize import IncrementalDetokenizer
from minisched.serve import protocol as p
from minisched.serve.engine_loop import EngineLoop
from minisched.serve.loop import ServingLoop
from minisched.serve.metrics import CONTENT_TYPE
from minisched.serve.state import DEFAULT_COMPLETION_TOKENS, OPENAI_FINISH, RequestHandle, ServerState

log = logging.getLogger("minisched.serve")


def create_app(
    engine,
    *,
    model_name: str,
    api_key: Optional[str] = None,
    max_queued_requests: int = 512,
    engine_loop: Optional[ServingLoop] = None,
) -> FastAPI:
    loop: ServingLoop = engine_loop or EngineLoop(engine)
    state = ServerState(engine, loop, model_name=model_name, api_key=api_key, max_queued_requests=max_queued_requests)
    for collector in loop.collectors():  # --dp: per-replica gauges
        state.metrics.registry.register(collector)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not loop.is_alive():
            loop.start()
        yield
        loop.stop()
        await asyncio.to_thread(loop.join, 10.0)

    app = FastAPI(title="minisched", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    _error_handlers(app)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)

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

    @app.get("/metrics")
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
        _check_common(state, body)
        ids = _completion_prompt(state, body.prompt)
        prepared = state.prepare(
            ids,
            max_tokens=body.max_tokens,
            default_max_tokens=DEFAULT_COMPLETION_TOKENS,
            **_sampling(body),
            param="prompt",
        )
        detok = IncrementalDetokenizer(state.tokenizer, prepared.sampling.stop)
        handle = state.admit(prepared, "cmpl")  # from here on the request is in the engine
        if body.stream:
            return _stream(handle, _completion_chunks(state, body, handle, detok))
        final_ids = await _collect(handle, request)
        if final_ids is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        detok.finish(handle.final.finish_reason, final_ids)
        choice = p.CompletionChoice(
            text=detok.text, finish_reason=_finish(handle), token_ids=final_ids if body.return_token_ids else None
        )
        resp = p.CompletionResponse(id=handle.rid, model=state.model_name, choices=[choice], usage=_usage(handle))
        return JSONResponse(resp.model_dump(exclude_none=True), headers={"X-Request-Id": handle.rid})

    @app.post("/v1/chat/completions")
    async def chat(body: p.ChatCompletionRequest, request: Request):
        _check_common(state, body)
        try:
            ids = state.tokenizer.encode_chat([{"role": m.role, "content": m.text()} for m in body.messages])
        except Exception as exc:  # the template's raise_exception (ValueError) or a jinja2 TemplateError
            raise p.APIError(400, f"messages: {exc}", param="messages") from exc
        prepared = state.prepare(
            ids, max_tokens=body.max_new_tokens(), default_max_tokens=None, **_sampling(body), param="messages"
        )
        detok = IncrementalDetokenizer(state.tokenizer, prepared.sampling.stop)
        handle = state.admit(prepared, "chatcmpl")
        if body.stream:
            return _stream(handle, _chat_chunks(state, body, handle, detok))
        final_ids = await _collect(handle, request)
        if final_ids is None:
            return Response(status_code=499)
        detok.finish(handle.final.finish_reason, final_ids)
        choice = p.ChatChoice(message=p.AssistantMessage(content=detok.text), finish_reason=_finish(handle))
        resp = p.ChatCompletionResponse(id=handle.rid, model=state.model_name, choices=[choice], usage=_usage(handle))
        return JSONResponse(resp.model_dump(), headers={"X-Request-Id": handle.rid})

    return app


# -- request helpers -----------------------------------------------------------------------------
def _card(state: ServerState) -> p.ModelCard:
    return p.ModelCard(id=state.model_name, created=state.created, max_model_len=state.max_context_len)


def _check_common(state: ServerState, body) -> None:
    state.check_model(body.model)
    bad = body.unsupported()
    if bad is not None:
        raise p.APIError(400, bad[1], param=bad[0], code="unsupported_parameter")


def _sampling(body) -> dict:
    return dict(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop=body.stop_list(),
        ignore_eos=body.ignore_eos,
    )


def _completion_prompt(state: ServerState, prompt) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise p.APIError(
                400,
                f"batched prompts ({len(prompt)}) are not supported; send one request per prompt",
                param="prompt",
                code="unsupported_parameter",
            )
        prompt = prompt[0]
    return state.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)


def _finish(handle: RequestHandle) -> str:
    return OPENAI_FINISH.get(handle.final.finish_reason, handle.final.finish_reason)


def _usage(handle: RequestHandle) -> p.Usage:
    return p.usage(handle.prompt_len, handle.num_tokens, handle.final.cached_tokens)


def _engine_error(handle: RequestHandle) -> p.APIError:
    upd = handle.final
    if upd.error_type == "invalid_request_error":
        return p.APIError(400, upd.error or "invalid request")
    return p.APIError(500, f"the engine failed on this request: {upd.error}", type="server_error")


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _gather(handle: RequestHandle) -> list[int]:
    ids: list[int] = []
    async for upd in handle.updates():
        ids.extend(upd.token_ids)
    return ids


async def _collect(handle: RequestHandle, request: Request) -> Optional[list[int]]:
    """All tokens of a non-streaming request; None if the client disconnected first (aborted)."""
    result = asyncio.ensure_future(_gather(handle))
    watch = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({result, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not result.done():
            result.cancel()
            handle.abort_unless_finished()
    if not result.done() or result.cancelled():
        return None
    if handle.final.finish_reason == "error":
        raise _engine_error(handle)
    return result.result()


# -- streaming -----------------------------------------------------------------------------------
class _EngineStream(StreamingResponse):
    """Server-sent events; however the response ends (done, client gone, cancelled), the request
    is released in the engine unless it already finished."""

    def __init__(self, content, handle: RequestHandle):
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": handle.rid},
        )
        self.handle = handle

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.handle.abort_unless_finished()


def _stream(handle: RequestHandle, chunks) -> _EngineStream:
    return _EngineStream(chunks, handle)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _sse_error(handle: RequestHandle) -> str:
    return _sse(_engine_error(handle).body())


async def _completion_chunks(state: ServerState, body: p.CompletionRequest, handle: RequestHandle, detok):
    head = {"id": handle.rid, "object": "text_completion", "created": handle.created, "model": state.model_name}
    async for upd in handle.updates():
        if upd.finish_reason == "error":
            yield _sse_error(handle)
            break
        reason = None if upd.finish_reason is None else _finish(handle)
        text = detok.add(upd.token_ids) if reason is None else detok.finish(upd.finish_reason, upd.token_ids)
        if upd.token_ids or reason:  # a chunk per engine update, even with no text yet (TTFT, token counts)
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            if body.return_token_ids:
                choice["token_ids"] = upd.token_ids
            yield _sse({**head, "choices": [choice]})
    else:
        if body.stream_options is not None and body.stream_options.include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(handle).model_dump()})
    yield "data: [DONE]\n\n"


async def _chat_chunks(state: ServerState, body: p.ChatCompletionRequest, handle: RequestHandle, detok):
    head = {"id": handle.rid, "object": "chat.completion.chunk", "created": handle.created, "model": state.model_name}

    def chunk(delta: dict, reason: Optional[str] = None) -> str:
        return _sse({**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]})

    yield chunk({"role": "assistant", "content": ""})
    async for upd in handle.updates():
        if upd.finish_reason == "error":
            yield _sse_error(handle)
            break
        if upd.finish_reason is None:
            if upd.token_ids:  # a chunk per engine update, even with no text yet (TTFT, token counts)
                yield chunk({"content": detok.add(upd.token_ids)})
            continue
        text = detok.finish(upd.finish_reason, upd.token_ids)
        if text:
            yield chunk({"content": text})
        yield chunk({}, _finish(handle))
    else:
        if body.stream_options is not None and body.stream_options.include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(handle).model_dump()})
    yield "data: [DONE]\n\n"


# -- errors and auth -----------------------------------------------------------------------------
_TYPE_TAGS = ("str", "int", "float", "bool", "list", "dict", "none")


def _field_path(loc) -> list[str]:
    """The request field of a pydantic error location: the "body" root dropped, cut before the first
    union-member tag ("str", "list[int]", "TextPart") that pydantic inserts for union fields."""
    out = []
    for x in loc:
        if x == "body" and not out:
            continue
        if isinstance(x, str) and (x in _TYPE_TAGS or "[" in x or x[:1].isupper() or x.startswith("function")):
            break
        out.append(str(x))
    return out


def _validation_message(err: dict) -> tuple[str, Optional[str]]:
    loc = _field_path(err.get("loc", ()))
    param = ".".join(loc) or None
    kind = err.get("type", "")
    if kind == "json_invalid":
        why = err.get("ctx", {}).get("error", "invalid JSON")
        return f"We could not parse the JSON body of your request ({why}).", None
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    if not loc and kind in ("model_attributes_type", "dict_type"):
        return "The request body must be a JSON object (send Content-Type: application/json).", None
    if kind == "missing":
        return f"Missing required parameter: '{param}'.", param
    return f"{param}: {err.get('msg', 'invalid value')}" if param else err.get("msg", "invalid request"), param


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(p.APIError)
    async def api_error(request: Request, exc: p.APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        message, param = _validation_message(errors[0]) if errors else ("invalid request", None)
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
        return JSONResponse(p.APIError(400, message, param=param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(
            p.APIError(exc.status_code, str(exc.detail), type=kind).body(),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.exception("unexpected error in %s %s", request.method, request.url.path)
        err = p.APIError(500, f"internal server error ({type(exc).__name__})", type="server_error")
        return JSONResponse(err.body(), status_code=500)


class BearerAuth:
    """Pure ASGI middleware: every /v1 route needs `Authorization: Bearer <api_key>` (checked before
    the body is read, so a keyless client learns nothing else)."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(got, self.key):
                err = p.APIError(
                    401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.", code="invalid_api_key"
                )
                resp = JSONResponse(err.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
                return await resp(scope, receive, send)
        await self.app(scope, receive, send)
