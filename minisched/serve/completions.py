"""POST /v1/completions: prompts (a string, a list of strings, token ids, a list of id lists) x `n`
choices, `echo`, `logprobs` (with `echo`: the prompt's too, its first token's null), streamed or not.

Choice `index` = prompt * n + choice. Usage counts each prompt once (its n choices share one
prefill) and every choice's tokens.
"""

from __future__ import annotations

from typing import Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from minisched.model.detokenize import IncrementalDetokenizer
from minisched.serve import protocol as p
from minisched.serve.entry import COMPLETIONS, Ask, prepare
from minisched.serve.logprob_format import LogprobFormatter, merge_completion
from minisched.serve.responses import EngineStream, check_openai, collect, finish_of, sse, sse_error, usage_of
from minisched.serve.state import Call, Prepared, ServerState


def prompts_of(prompt) -> list[Union[str, list[int]]]:
    """The prompts of a body's `prompt`: a string or token ids is one, a list of them several."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return list(prompt)
    return [prompt]


class _Choice:
    """One choice's text and logprobs as they grow."""

    def __init__(self, state: ServerState, prepared: Prepared, text: Optional[str], echo: bool, fmt):
        sp = prepared.sampling
        self.detok = IncrementalDetokenizer(
            state.tokenizer,
            sp.stop,
            include_stop=sp.include_stop_str_in_output,
            skip_special_tokens=sp.skip_special_tokens,
        )
        self.ids = prepared.prompt_ids
        self.echo = echo
        self.prompt_text = (
            (text if text is not None else state.tokenizer.decode(self.ids, skip_special_tokens=False)) if echo else ""
        )
        self.fmt = fmt
        self.want_lp = sp.logprobs is not None
        self.offset = 0
        self.started = False
        self.token_ids: list[int] = []

    def piece(self, upd) -> tuple[str, Optional[dict]]:
        """The text and logprobs of this update (the echoed prompt first, once)."""
        text = (
            self.detok.add(upd.token_ids)
            if upd.finish_reason is None
            else self.detok.finish(upd.finish_reason, upd.token_ids)
        )
        self.token_ids += upd.token_ids
        lp = None
        if not self.started:
            self.started = True
            text = self.prompt_text + text
            if self.echo and self.want_lp:
                lp, _ = self.fmt.completion(self.ids, upd.prompt_logprobs or [None] * len(self.ids), 0)
            self.offset = len(self.prompt_text)  # the completion's tokens start after the echoed prompt
        if self.want_lp:
            mine, self.offset = self.fmt.completion(
                upd.token_ids, upd.logprobs or [None] * len(upd.token_ids), self.offset
            )
            lp = merge_completion(lp, mine)
        return text, lp


async def completions(state: ServerState, body: p.CompletionRequest, request: Request) -> Response:
    check_openai(state, body)
    prompts = prompts_of(body.prompt)
    echo_lp = body.logprobs if body.echo and body.logprobs is not None else None
    sampling = body.to_sampling(logprobs=body.logprobs, prompt_logprobs=echo_lp)
    asks = [Ask(x, sampling, body.max_tokens) for x in prompts]
    prepared = prepare(state, asks, body.n, COMPLETIONS, "prompt")
    n, fmt = body.n, LogprobFormatter(state.tokenizer)
    texts = [x if isinstance(x, str) else None for x in prompts]
    choices = [_Choice(state, prep, text, body.echo, fmt) for prep, text in zip(prepared, texts) for _ in range(n)]
    call = state.admit(prepared, COMPLETIONS.kind, n)  # from here on the requests are in the engine
    if body.stream:
        return EngineStream(_chunks(state, body, call, choices), call)
    got = await collect(call, request)
    if got is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    out = []
    for i, (h, c, upds) in enumerate(zip(call.handles, choices, got)):
        text, lps = "", None
        for upd in upds:
            t, lp = c.piece(upd)
            text += t
            lps = merge_completion(lps, lp) if lp is not None else lps
        out.append(
            p.CompletionChoice(
                index=i,
                text=text,
                logprobs=lps,
                finish_reason=finish_of(h),
                token_ids=c.token_ids if body.return_token_ids else None,
            )
        )
    resp = p.CompletionResponse(id=call.rid, model=state.model_name, choices=out, usage=usage_of(call, n))
    return JSONResponse(resp.model_dump(exclude_none=True), headers={"X-Request-Id": call.rid})


async def _chunks(state: ServerState, body: p.CompletionRequest, call: Call, choices: list[_Choice]):
    head = {"id": call.rid, "object": "text_completion", "created": call.created, "model": state.model_name}
    opts = body.stream_options
    failed = False
    async for i, upd in call.updates():
        h = call.handles[i]
        if upd.finish_reason == "error":
            yield sse_error(h)
            failed = True
            break
        text, lp = choices[i].piece(upd)
        reason = None if upd.finish_reason is None else finish_of(h)
        if upd.token_ids or reason or text:  # a chunk per engine update, even with no text yet (TTFT, counts)
            choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": reason}
            if body.return_token_ids:
                choice["token_ids"] = upd.token_ids
            chunk = {**head, "choices": [choice]}
            if opts is not None and opts.continuous_usage_stats:
                chunk["usage"] = usage_of(call, body.n).model_dump()
            yield sse(chunk)
    if not failed and opts is not None and opts.include_usage:
        yield sse({**head, "choices": [], "usage": usage_of(call, body.n).model_dump()})
    yield "data: [DONE]\n\n"
