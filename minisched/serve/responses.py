"""What the generation routes share after the entry (entry.py): collecting a call's choices, server-sent
events, usage and engine errors; and the OpenAI routes' own checks."""

from __future__ import annotations

import asyncio
import json
from typing import Optional

from fastapi import Request
from fastapi.responses import StreamingResponse

from minisched.serve import protocol as p
from minisched.serve.messages import Update
from minisched.serve.state import OPENAI_FINISH, Call, RequestHandle, ServerState


def check_openai(state: ServerState, body) -> None:
    """What only the OpenAI routes check: the model named, the fields this server cannot honour (a 400), the
    vendor extras ignored (logged once). The rest is every route's: entry.py."""
    state.check_model(body.model)
    bad = body.unsupported()
    if bad is not None:
        raise p.APIError(400, bad[1], param=bad[0], code="unsupported_parameter")
    body.ignored_fields()


def final_of(handle: RequestHandle) -> Update:
    """The handle's finishing update (its callers run once the request has finished)."""
    upd = handle.final
    if upd is None:
        raise RuntimeError(f"request {handle.rid} has no finishing update yet")
    return upd


def finish_of(handle: RequestHandle) -> str:
    reason = final_of(handle).finish_reason
    if reason is None:  # never: the final update is the one with a finish reason (RequestHandle.deliver)
        raise RuntimeError(f"request {handle.rid}'s finishing update has no finish reason")
    return OPENAI_FINISH.get(reason, reason)


def usage_of(call: Call, n: int) -> p.Usage:
    """The prompts counted once each (their n choices share the prefill), every choice's tokens."""
    firsts = call.handles[::n]
    return p.usage(
        sum(h.prompt_len for h in firsts),
        sum(h.num_tokens for h in call.handles),
        sum(h.final.cached_tokens if h.final else 0 for h in firsts),
    )


def engine_error(handle: RequestHandle) -> p.APIError:
    upd = final_of(handle)
    if upd.error_type == "invalid_request_error":
        return p.APIError(400, upd.error or "invalid request")
    return p.APIError(500, f"the engine failed on this request: {upd.error}", type="server_error")


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(call: Call, request: Request) -> Optional[list[list]]:
    """Every choice's updates (a list per choice, in index order); None if the client disconnected
    first (then the unfinished choices are aborted). A failed choice raises its error."""
    got: list[list] = [[] for _ in call.handles]

    async def gather():
        async for i, upd in call.updates():
            got[i].append(upd)

    result = asyncio.ensure_future(gather())
    watch = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({result, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not result.done():
            result.cancel()
            call.abort_unfinished()
    if not result.done() or result.cancelled():
        return None
    for h in call.handles:
        if final_of(h).finish_reason == "error":
            raise engine_error(h)
    return got


class EngineStream(StreamingResponse):
    """Server-sent events; however the response ends (done, client gone, cancelled), the call's
    requests are released in the engine unless they already finished."""

    def __init__(self, content, call: Call):
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": call.rid},
        )
        self.call = call

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.call.abort_unfinished()


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def sse_error(handle: RequestHandle) -> str:
    return sse(engine_error(handle).body())
