"""POST /v1/chat/completions: the messages through the model's chat template, `n` choices,
`logprobs` / `top_logprobs`, structured outputs, streamed or not.

A stream's first chunk of each choice carries the role together with the first token's text
(not a role-only chunk at admission: benchmark clients take the first chunk as the first
token, so an early one would make every TTFT they measure a few milliseconds).
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from minisched.model.detokenize import IncrementalDetokenizer
from minisched.serve import protocol as p
from minisched.serve.entry import CHAT, Ask, ChatPrompt, prepare
from minisched.serve.logprob_format import LogprobFormatter
from minisched.serve.responses import EngineStream, check_openai, collect, finish_of, sse, sse_error, usage_of
from minisched.serve.state import Call, ServerState


async def chat(state: ServerState, body: p.ChatCompletionRequest, request: Request) -> Response:
    check_openai(state, body)
    messages = ChatPrompt([{"role": m.role, "content": m.text()} for m in body.messages])
    k = (body.top_logprobs or 0) if body.logprobs else None
    ask = Ask(messages, body.to_sampling(logprobs=k), body.max_new_tokens())
    (prepared,) = prepare(state, [ask], body.n, CHAT, "messages")
    sp, n = prepared.sampling, body.n
    detoks = [
        IncrementalDetokenizer(
            state.tokenizer,
            sp.stop,
            include_stop=sp.include_stop_str_in_output,
            skip_special_tokens=sp.skip_special_tokens,
        )
        for _ in range(n)
    ]
    fmt = LogprobFormatter(state.tokenizer)
    call = state.admit([prepared], CHAT.kind, n)
    if body.stream:
        return EngineStream(_chunks(state, body, call, detoks, fmt), call)
    got = await collect(call, request)
    if got is None:
        return Response(status_code=499)
    choices = []
    for i, (h, detok, upds) in enumerate(zip(call.handles, detoks, got)):
        ids = [t for u in upds for t in u.token_ids]
        final = h.final
        if final is None:  # collect returns once every choice has finished
            raise RuntimeError(f"{h.rid} has no final update after collect")
        detok.finish(final.finish_reason, ids)
        lps = fmt.chat([e for u in upds for e in (u.logprobs or [])]) if k is not None else None
        choices.append(
            p.ChatChoice(
                index=i, message=p.AssistantMessage(content=detok.text), logprobs=lps, finish_reason=finish_of(h)
            )
        )
    resp = p.ChatCompletionResponse(id=call.rid, model=state.model_name, choices=choices, usage=usage_of(call, n))
    return JSONResponse(resp.model_dump(), headers={"X-Request-Id": call.rid})


async def _chunks(state: ServerState, body: p.ChatCompletionRequest, call: Call, detoks, fmt: LogprobFormatter):
    head = {"id": call.rid, "object": "chat.completion.chunk", "created": call.created, "model": state.model_name}
    want_lp = body.logprobs
    started = [False] * len(call.handles)

    def chunk(i: int, delta: dict, reason=None, logprobs=None) -> str:
        if not started[i]:
            started[i] = True
            delta = {"role": "assistant", **delta}
        choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return sse({**head, "choices": [choice]})

    failed = False
    async for i, upd in call.updates():
        h = call.handles[i]
        if upd.finish_reason == "error":
            yield sse_error(h)
            failed = True
            break
        lp = fmt.chat(upd.logprobs or []) if want_lp and upd.token_ids else None
        if upd.finish_reason is None:
            if upd.token_ids:  # a chunk per engine update, even with no text yet (TTFT, token counts)
                yield chunk(i, {"content": detoks[i].add(upd.token_ids)}, logprobs=lp)
            continue
        text = detoks[i].finish(upd.finish_reason, upd.token_ids)
        if text or upd.token_ids or not started[i]:
            yield chunk(i, {"content": text}, logprobs=lp)
        yield chunk(i, {}, finish_of(h))
    if not failed and body.stream_options is not None and body.stream_options.include_usage:
        yield sse({**head, "choices": [], "usage": usage_of(call, body.n).model_dump()})
    yield "data: [DONE]\n\n"
