"""`Engine.generate` and `Engine.stream`: run a list of prompts to completion, or stream them.

Each prompt becomes `n` requests (`Engine.add_choices`); a bad prompt becomes an Output with
`error` and the others run. Both abort their own requests when interrupted or closed, and
touch nobody else's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional, Protocol

import numpy as np
import torch

from minisched.base.values import is_int
from minisched.engine.outputs import Output, StreamChunk
from minisched.model.detokenize import IncrementalDetokenizer
from minisched.sched.req import Req
from minisched.sched.sampling_params import InvalidRequest


class EngineSurface(Protocol):
    """What these functions use of the Engine (engine.py), which calls them."""

    scheduler: Any
    tokenizer: Any

    def add_choices(self, prompt, sampling, n: int, *, rids=None, chat: bool = False) -> list[Req]: ...

    def abort(self, rid: str) -> bool: ...

    def has_work(self) -> bool: ...

    def step(self) -> list[Req]: ...

    def output_of(self, req: Req, index: int = 0, choice: int = 0) -> Output: ...


def _submit(
    engine: EngineSurface, prompts, sampling, chat: bool, n: int
) -> tuple[list[Output], dict[str, tuple[int, int]]]:
    if isinstance(prompts, (str, dict, torch.Tensor, np.ndarray)) or (
        isinstance(prompts, (list, tuple)) and prompts and is_int(prompts[0])
    ):
        raise TypeError(
            "prompts must be a list of prompts (strings, token-id lists or arrays, chat message "
            "lists); wrap a single prompt in a list"
        )
    if not is_int(n) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    prompts = list(prompts)
    params = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
    outputs: list[Output] = []
    live: dict[str, tuple[int, int]] = {}  # rid -> (position in outputs, choice)
    try:
        for i, (p, sp) in enumerate(zip(prompts, params)):
            try:
                reqs = engine.add_choices(p, sp, n, chat=chat)
            except (InvalidRequest, ValueError, TypeError) as exc:
                outputs.extend(
                    Output(index=i, rid="", error=str(exc), finish_reason="error", choice=j) for j in range(n)
                )
                continue
            for j, req in enumerate(reqs):
                live[req.rid] = (len(outputs), j)
                outputs.append(Output(index=i, rid=req.rid, prompt_ids=list(req.prompt_ids), choice=j))
    except BaseException:  # e.g. Ctrl-C while tokenizing: nothing of this call stays queued
        _abort_all(engine, live)
        raise
    return outputs, live


def _abort_all(engine: EngineSurface, live: dict) -> None:
    for rid in list(live):
        engine.abort(rid)
    live.clear()


def _drive(engine: EngineSurface) -> list[Req]:
    if not engine.has_work():  # cannot happen while requests are live; never spin
        raise RuntimeError("scheduler idle with unfinished requests")
    return engine.step()


def generate(
    engine: EngineSurface,
    prompts: Sequence,
    sampling=None,
    *,
    chat: bool = False,
    n: int = 1,
    progress: Optional[Callable[[int, int], None]] = None,
) -> list[Output]:
    outputs, live = _submit(engine, prompts, sampling, chat, n)
    total = len(live)
    try:
        while live:
            for req in _drive(engine):
                pos = live.pop(req.rid, None)
                if pos is not None:
                    outputs[pos[0]] = engine.output_of(req, outputs[pos[0]].index, pos[1])
            if progress is not None:
                progress(total - len(live), total)
    except BaseException:
        _abort_all(engine, live)
        raise
    return outputs


def stream(
    engine: EngineSurface, prompts: Sequence, sampling=None, *, chat: bool = False, n: int = 1
) -> Iterator[StreamChunk]:
    outputs, live = _submit(engine, prompts, sampling, chat, n)
    try:
        yield from _stream(engine, outputs, live)
    finally:
        _abort_all(engine, live)


def _stream(engine: EngineSurface, outputs: list[Output], live: dict[str, tuple[int, int]]) -> Iterator[StreamChunk]:
    for failed in outputs:
        if failed.error is not None:
            yield StreamChunk(failed.index, failed.rid, "", [], True, failed, failed.choice)
    reqs = {rid: engine.scheduler.get(rid) for rid in live}
    detok = {
        rid: IncrementalDetokenizer(
            engine.tokenizer,
            r.sampling.stop,
            include_stop=r.sampling.include_stop_str_in_output,
            skip_special_tokens=r.sampling.skip_special_tokens,
        )
        for rid, r in reqs.items()
    }
    sent = dict.fromkeys(live, 0)
    while live:
        finished = {r.rid for r in _drive(engine)}
        for rid in list(live):
            req, n = reqs[rid], sent[rid]
            done = rid in finished
            if len(req.output_ids) == n and not done:
                continue
            new = req.output_ids[n:]
            if done:
                delta = detok[rid].finish(req.finish_reason.value if req.finish_reason else None, new)
            else:
                delta = detok[rid].add(new)
            sent[rid] = len(req.output_ids)
            pos, choice = live[rid]
            lps = None if req.output_logprobs is None else req.output_logprobs[n:]
            out = engine.output_of(req, outputs[pos].index, choice) if done else None
            if done:
                del live[rid]
            yield StreamChunk(outputs[pos].index, rid, delta, list(new), done, out, choice, lps)
