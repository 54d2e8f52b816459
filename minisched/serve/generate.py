"""POST /generate: SGLang's native generation API, through the entry every route shares (entry.py: the
same bounds, checks and defaults' table as the OpenAI routes) and their admission path.

A body has `text` (a string, or a list: a batch) or `input_ids` (a list of ids, or a list of id
lists), `sampling_params` (one dict, or one per prompt), `stream`, `rid`, `return_logprob`,
`top_logprobs_num`, `logprob_start_len` (sglang_protocol.py). The answer, per prompt x `n`
choice (index = prompt * n + choice, as SGLang orders a batch's samples):

    {"text": ..., "output_ids": [...], "meta_info": {"id", "finish_reason", "prompt_tokens",
     "completion_tokens", "cached_tokens", "e2e_latency", [logprob lists]}}

one object for a single prompt with n = 1, a list otherwise. `finish_reason` is SGLang's shape:
`{"type": "stop", "matched": <token id or stop string>}`, `{"type": "length", "length": N}`,
`{"type": "abort", "message": ...}`, null while streaming. With `return_logprob`, meta_info has
`output_token_logprobs` (and `input_token_logprobs` from `logprob_start_len` when it is >= 0;
the first prompt position's logprob is null), each entry `[logprob, token_id, text]` (text only
with `return_text_in_logprobs`, else null); with `top_logprobs_num` k > 0 also
`output_top_logprobs` / `input_top_logprobs`, k entries per position.

Streamed (`stream: true`): server-sent events `data: {...}` whose `text`, `output_ids` and logprob
lists are cumulative (SGLang's default; a client prints `text[len(previous):]`), each with
`"index"` for a batch or n > 1, ending in `data: [DONE]`. Errors are SGLang's body
`{"error": {"message": ...}}` (400 for a bad request, 429 / 503 as on the OpenAI routes, 500 for
an engine failure); in a stream, one `data: {"error": ...}` event, then `data: [DONE]`.
"""

from __future__ import annotations

import time
from typing import Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from minisched.model.detokenize import IncrementalDetokenizer
from minisched.serve import request_id
from minisched.serve.entry import GENERATE, Ask, prepare
from minisched.serve.logprob_format import LogprobFormatter
from minisched.serve.protocol import APIError
from minisched.serve.responses import EngineStream, collect, engine_error, sse
from minisched.serve.sglang_protocol import GenerateRequest, SGLangSampling
from minisched.serve.state import Call, Prepared, RequestHandle, ServerState


def sglang_error(status: int, message: str, headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status, headers=headers)


def _validation_message(exc: ValidationError) -> str:
    errors = exc.errors()
    if not errors:
        return "invalid request"
    err = errors[0]
    if err.get("type") == "json_invalid":
        return f"We could not parse the JSON body of your request ({err.get('ctx', {}).get('error', 'invalid JSON')})."
    loc = ".".join(str(x) for x in err.get("loc", ()) if not (isinstance(x, str) and ("[" in x or x[:1].isupper())))
    msg = f"{loc}: {err.get('msg', 'invalid value')}" if loc else err.get("msg", "invalid request")
    return msg + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else "")


async def generate(state: ServerState, request: Request) -> Response:
    try:
        body = GenerateRequest.model_validate_json(await request.body())
    except ValidationError as exc:
        return sglang_error(400, _validation_message(exc))
    try:
        return await _generate(state, body, request)
    except APIError as exc:
        return sglang_error(exc.status, exc.info.message, exc.headers)


class _Output:
    """One choice's cumulative text, ids and logprobs, and its SGLang-shaped body."""

    def __init__(self, state: ServerState, prepared: Prepared, meta_id: str, lp: Optional[tuple], fmt):
        sp = prepared.sampling
        self.tokenizer, self.sampling, self.prompt_ids = state.tokenizer, sp, prepared.prompt_ids
        self.detok = IncrementalDetokenizer(
            state.tokenizer,
            sp.stop,
            include_stop=sp.include_stop_str_in_output,
            skip_special_tokens=sp.skip_special_tokens,
        )
        self.meta_id = meta_id
        self.lp = lp  # None, or (top_logprobs_num, logprob_start_len or -1, with text)
        self.fmt = fmt
        self.text = ""
        self.ids: list[int] = []
        self.out_lp: list = []
        self.in_lp: Optional[list] = None

    def add(self, upd) -> None:
        if upd.prompt_logprobs is not None:
            self.in_lp = upd.prompt_logprobs
        self.ids += upd.token_ids
        self.out_lp += upd.logprobs or []
        if upd.finish_reason is None:
            self.text += self.detok.add(upd.token_ids)
        else:
            self.text += self.detok.finish(upd.finish_reason, upd.token_ids)

    def body(self, h: RequestHandle, upd) -> dict:
        """The body after update `upd` (its finish, or None while the choice runs)."""
        meta = {
            "id": self.meta_id,
            "finish_reason": None if upd is None else self._finish(upd),
            "prompt_tokens": h.prompt_len,
            "completion_tokens": len(self.ids),
            "cached_tokens": 0 if upd is None else upd.cached_tokens,
            "e2e_latency": round(time.monotonic() - h.arrival, 6),
        }
        if self.lp is not None:
            meta.update(self._logprobs())
        return {"text": self.text, "output_ids": list(self.ids), "meta_info": meta}

    def _finish(self, upd) -> dict:
        reason = upd.finish_reason
        if reason == "stop_token":
            return {"type": "stop", "matched": self.ids[-1] if self.ids else None}
        if reason == "stop_str":
            raw = self.tokenizer.decode(self.ids, skip_special_tokens=self.sampling.skip_special_tokens)
            hits = [(raw.find(s), s) for s in self.sampling.stop if s in raw]
            return {"type": "stop", "matched": min(hits)[1] if hits else None}
        if reason in ("max_new_tokens", "length"):
            return {"type": "length", "length": len(self.ids)}
        return {"type": "abort", "message": upd.error or "the request was aborted"}

    def _logprobs(self) -> dict:
        lp = self.lp
        if lp is None:  # never: called only for a request that asked for logprobs
            raise RuntimeError("the request asked for no logprobs")
        top, start, with_text = lp

        def text(t: int):
            return self.fmt.token(t) if with_text else None

        def tops(e):
            return None if e is None else [[lp, t, text(t)] for t, lp in e.top]

        out = {"output_token_logprobs": [[e.logprob, e.token_id, text(e.token_id)] for e in self.out_lp]}
        if top:
            out["output_top_logprobs"] = [tops(e) for e in self.out_lp]
        if start >= 0:
            entries = self.in_lp or []
            ids = self.prompt_ids[start : start + len(entries)]
            out["input_token_logprobs"] = [[None if e is None else e.logprob, t, text(t)] for t, e in zip(ids, entries)]
            if top:
                out["input_top_logprobs"] = [tops(e) for e in entries]
        return out


async def _generate(state: ServerState, body: GenerateRequest, request: Request) -> Response:
    is_batch, prompts = body.batch()
    body.check_logprob_fields()
    count = len(prompts)
    sps = body.per_prompt("sampling_params", count, SGLangSampling())
    rids = body.per_prompt("rid", count, None)
    want_lp = body.per_prompt("return_logprob", count, False)
    starts = body.per_prompt("logprob_start_len", count, -1)
    tops = body.per_prompt("top_logprobs_num", count, 0)
    n = sps[0].n
    if any(sp.n != n for sp in sps):
        raise APIError(400, "sampling_params.n must be the same for every prompt of a batch")
    if count == 1:
        request_id.adopt(rids[0])  # SGLang's rid names the request in the logs (unless X-Request-Id did)
    param = "text" if body.text is not None else "input_ids"
    asks = [
        Ask(
            prompt,
            sp.to_sampling(
                priority=body.priority,
                logprobs=top if lp else None,
                prompt_logprobs=top if lp and start >= 0 else None,
                start=max(start, 0),
            ),
            sp.max_new_tokens,
        )
        for prompt, sp, lp, start, top in zip(prompts, sps, want_lp, starts, tops)
    ]
    prepared = prepare(state, asks, n, GENERATE, param)  # the bounds and checks of every route (entry.py)
    lps = []
    for prep, lp, start, top in zip(prepared, want_lp, starts, tops):
        if lp and start >= len(prep.prompt_ids):
            raise APIError(
                400, f"logprob_start_len ({start}) must be less than the prompt's {len(prep.prompt_ids)} tokens"
            )
        lps.append((top, start, body.return_text_in_logprobs) if lp else None)
    fmt = LogprobFormatter(state.tokenizer)
    call = state.admit(prepared, GENERATE.kind, n)
    outs = []
    for i, h in enumerate(call.handles):
        p, j = divmod(i, n)
        given = rids[p]
        meta_id = h.rid if not given else (given if n == 1 else f"{given}-{j}")
        outs.append(_Output(state, prepared[p], meta_id, lps[p], fmt))
    many = is_batch or n > 1
    if body.stream:
        return EngineStream(_events(call, outs, many), call)
    got = await collect(call, request)
    if got is None:
        return Response(status_code=499)  # the client is gone
    results = []
    for h, out, upds in zip(call.handles, outs, got):
        for upd in upds:
            out.add(upd)
        results.append(out.body(h, h.final))
    return JSONResponse(results if many else results[0], headers={"X-Request-Id": call.rid})


async def _events(call: Call, outs: list[_Output], many: bool):
    async for i, upd in call.updates():
        h = call.handles[i]
        if upd.finish_reason == "error":
            yield sse({"error": {"message": engine_error(h).info.message}})
            break
        outs[i].add(upd)
        if upd.token_ids or upd.finish_reason is not None:
            event = outs[i].body(h, upd if upd.finish_reason is not None else None)
            if many:
                event["index"] = i
            yield sse(event)
    yield "data: [DONE]\n\n"
