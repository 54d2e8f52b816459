"""`Engine`: a model, a KV pool and a scheduler, driven step by step.

    engine = Engine("smollm2")                       # or a .gguf, an HF dir, "dummy:tiny"
    outs = engine.generate(["Hello", "2+2="], SamplingParams(max_new_tokens=32))
    for chunk in engine.stream([[{"role": "user", "content": "Hi"}]]): print(chunk.delta, end="")

Each `step()` is the whole story: the scheduler picks a batch, the `ModelRunner` computes
it and samples, the scheduler records the tokens and finishes requests. Prompts are text,
token-id lists, or chat message lists (rendered with the model's chat template). The model's
stop tokens (its EOS and end-of-turn tokens) are added to every request's (unless `ignore_eos`); stop strings are checked
on the decoded tail after each token and cut from the final text.

A bad request (empty or over-long prompt, invalid sampling) raises `InvalidRequest` from
`add_request`; `generate` instead reports it in that request's output (`error`) and runs the
others.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional, Union

import numpy as np
import torch

from minisched.base.values import is_int
from minisched.engine.build import build_parts
from minisched.engine.config import EngineConfig
from minisched.engine.generate import generate, stream
from minisched.engine.outputs import Output, StreamChunk
from minisched.engine.overlap import OverlapLoop
from minisched.engine.structured import GRAMMAR_FAILED, GrammarCompiler
from minisched.model.detokenize import final_text
from minisched.model.llama import LlamaModel
from minisched.model.tokenizer import MiniTokenizer
from minisched.parallel.launch import TPSession
from minisched.sched.req import Req
from minisched.sched.sampling_params import InvalidRequest, SamplingParams
from minisched.sched.scheduler import Scheduler

Prompt = Union[str, Sequence[int], Sequence[dict]]


class Engine:
    """`Engine(model, **options)` or `Engine(config=EngineConfig(...))`: options are EngineConfig and
    SchedulerConfig fields (engine/config.py). `model` is a name or path (it sets `config.model`) or
    a loaded `LlamaModel` (then `tokenizer=` is required). `tp=N` starts N tensor-parallel ranks
    (closed by `close()`, at exit, or by leaving a `with` block); `tp_session=` runs on a session
    started by the caller, who closes it. Everything is built by engine/build.py; this wires it."""

    def __init__(
        self,
        model: Union[str, LlamaModel, None] = None,
        *,
        config: Optional[EngineConfig] = None,
        tokenizer: Optional[MiniTokenizer] = None,
        tp_session: Optional[TPSession] = None,
        **options,
    ):
        if isinstance(model, str):
            options["model"] = model
        elif model is not None and not isinstance(model, LlamaModel):
            raise TypeError(f"model must be a name, a path or a LlamaModel, got {type(model).__name__}")
        config = EngineConfig.from_options(config, **options)
        parts = build_parts(
            config, model=model if isinstance(model, LlamaModel) else None, tokenizer=tokenizer, tp_session=tp_session
        )
        self.config, self.model, self.model_name = parts.config, parts.model, parts.model_name
        self.tokenizer, self.cfg = parts.tokenizer, parts.model.cfg
        self.device, self.backend, self.quant = parts.device, parts.backend, parts.quant
        self.num_threads, self.pack_weights, self.cuda_graph = parts.num_threads, parts.pack_weights, parts.cuda_graph
        self.sched_config, self.kv_cache, self.runner = parts.sched_config, parts.kv_cache, parts.runner
        self.host_tier, self.tp_session = parts.host_tier, parts.tp_session
        # a session this engine started is closed by close(), or at exit
        session = parts.tp_session
        self._closer = weakref.finalize(self, session.close) if parts.owns_tp_session and session is not None else None
        self.scheduler = Scheduler(
            self.sched_config, stop_checker=self._stop_hit, host_tier=self.host_tier, drafter=parts.drafter
        )
        # Overlap scheduling (engine/overlap.py): forwards on a worker thread, the next step scheduled
        # while one runs, outputs identical. Default: on for CUDA, off for CPU (benchmarks/RESULTS.md).
        self.overlap = config.overlap if config.overlap is not None else self.device.type == "cuda"
        self._overlap = OverlapLoop(self.scheduler, self.runner) if self.overlap else None
        self.grammars = GrammarCompiler(
            self.tokenizer, self.cfg.vocab_size, self.tokenizer.eos_token_id, timeout=config.grammar_compile_timeout
        )
        self._ids = itertools.count()
        # n > 1: each choice's shared-prefill request, and the choices still live per prefill, so
        # that aborting a prompt's last choice aborts its prefill too (else it runs on for nobody)
        self._lead_of: dict[str, str] = {}
        self._choices_of: dict[str, set[str]] = {}
        self.step_times: list[tuple[float, float]] = []  # (start, end) of each forward step
        self.last_error: Optional[BaseException] = None  # the last exception a step turned into request errors

    def close(self) -> None:
        """Stop the tensor-parallel ranks this engine started (idempotent; nothing to do otherwise)."""
        if self._closer is not None:
            self._closer()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def fresh(self, **options) -> Engine:
        """A new engine (empty KV pool and radix cache) on this engine's loaded model, tokenizer and
        tensor-parallel session, with these options changed (the pool keeps its size unless they change
        it). Under tensor parallelism the new engine takes the ranks over: this one stops working."""
        if "num_pages" not in options and "mem_fraction" not in options:
            options["num_pages"] = self.sched_config.num_pages
        config = self.config.with_options(model=self.model_name, **options)
        if self.tp_session is not None:
            return Engine(config=config, tokenizer=self.tokenizer, tp_session=self.tp_session)
        return Engine(self.model, config=config, tokenizer=self.tokenizer)

    def health(self) -> Optional[str]:
        """None while the engine can serve; else why not (a tensor-parallel rank died or hung)."""
        return self.runner.health()

    # -- requests ---------------------------------------------------------------------------------------
    def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
        """Text, chat messages, or token ids (a list of ints, a NumPy integer array, a 1-D integer tensor)."""
        if isinstance(prompt, str):
            if chat:
                return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, torch.Tensor) or hasattr(prompt, "__array__"):
            arr = prompt.detach().cpu().numpy() if isinstance(prompt, torch.Tensor) else np.asarray(prompt)
            if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
                raise InvalidRequest(
                    f"a token-id array prompt must be 1-D integers, got shape {arr.shape} dtype {arr.dtype}"
                )
            prompt = arr.tolist()
        items: list[Any] = list(prompt)  # the caller's values, checked below
        if items and all(isinstance(m, dict) for m in items):
            return self.tokenizer.encode_chat(items)
        if all(is_int(t) for t in items):
            vocab = self.cfg.vocab_size
            for pos, tok in enumerate(items):
                if not 0 <= tok < vocab:
                    raise InvalidRequest(
                        f"prompt token {tok} at position {pos} is out of range (vocabulary of {vocab})"
                    )
            return [int(t) for t in items]
        raise InvalidRequest("a prompt must be a string, a list of token ids or a list of chat messages")

    def _with_eos(self, sampling: SamplingParams) -> SamplingParams:
        """The model's stop tokens (the tokenizer's EOS and end-of-turn tokens, else the config's EOS) added."""
        stops = self.tokenizer.stop_token_ids
        if not stops and self.cfg.eos_token_id is not None:
            stops = (self.cfg.eos_token_id,)
        missing = tuple(t for t in stops if t not in sampling.stop_token_ids)
        if not missing or sampling.ignore_eos:
            return sampling
        return dataclasses.replace(sampling, stop_token_ids=sampling.stop_token_ids + missing)

    def add_request(
        self,
        prompt: Prompt,
        sampling: Optional[SamplingParams] = None,
        *,
        rid: Optional[str] = None,
        chat: bool = False,
        priority: Optional[int] = None,
        arrival_time: Optional[float] = None,
    ) -> Req:
        """Queue one request; raises InvalidRequest (a ValueError) if it can never run. `priority` (lower
        is more urgent; with `priority_scheduling`) replaces `sampling.priority`; `arrival_time`
        (time.monotonic()) dates its arrival back (a replayed workload's scheduled arrival)."""
        if priority is not None:
            base = SamplingParams(**sampling) if isinstance(sampling, dict) else (sampling or SamplingParams())
            sampling = dataclasses.replace(base, priority=priority)
        rids = None if rid is None else [rid]
        return self.add_choices(prompt, sampling, 1, rids=rids, chat=chat, arrival_time=arrival_time)[0]

    def add_choices(
        self,
        prompt: Prompt,
        sampling: Optional[SamplingParams],
        n: int,
        *,
        rids: Optional[Sequence[str]] = None,
        chat: bool = False,
        arrival_time: Optional[float] = None,
    ) -> list[Req]:
        """Queue `n` choices of one prompt (OpenAI's `n`); returns their requests. For n > 1 the prompt
        is prefilled once (SGLang's parallel sampling): a prefill-only request goes first and the
        choices wait for it, then reuse its full pages from the radix cache (the partial last page
        and the last token are computed again per choice). Choice j samples with `seed + j` when a
        seed is given (else with fresh entropy)."""
        if sampling is None:
            sampling = SamplingParams()
        elif isinstance(sampling, dict):
            sampling = SamplingParams(**sampling)
        if not is_int(n) or n < 1:
            raise InvalidRequest(f"n must be an int >= 1, got {n!r}")
        rids = list(rids) if rids is not None else [f"r{next(self._ids)}" for _ in range(n)]
        if len(rids) != n:
            raise InvalidRequest(f"{len(rids)} request ids for n={n}")
        ids = self.encode(prompt, chat)
        sampling = self._with_eos(sampling)
        gate = self.grammars.submit(sampling.grammar) if sampling.grammar is not None else None
        if n == 1:
            return [self.scheduler.add_request(rids[0], ids, sampling, gate=gate, arrival_time=arrival_time)]
        lead_sp = dataclasses.replace(sampling, max_new_tokens=0, logprobs=None, grammar=None)
        lead = self.scheduler.add_request(f"{rids[0]}#prompt", ids, lead_sp, arrival_time=arrival_time)
        reqs = []
        try:
            for j, rid in enumerate(rids):
                sp = (
                    sampling
                    if sampling.seed is None
                    else dataclasses.replace(sampling, seed=(sampling.seed + j) % 2**64)
                )
                reqs.append(
                    self.scheduler.add_request(
                        rid,
                        ids,
                        dataclasses.replace(sp, prompt_logprobs=None),
                        after=lead,
                        gate=gate,
                        arrival_time=arrival_time,
                    )
                )
        except BaseException:
            for r in [lead, *reqs]:
                self.scheduler.abort(r.rid)
            raise
        self._choices_of[lead.rid] = set(rids)
        self._lead_of.update((rid, lead.rid) for rid in rids)
        return reqs  # the leader computes the prompt logprobs once (output_of reads them there)

    def abort(self, rid: str) -> bool:
        found = self.scheduler.abort(rid)
        self._choice_ended(rid, abort_prefill=True)
        return found

    def _choice_ended(self, rid: str, abort_prefill: bool) -> None:
        lead = self._lead_of.pop(rid, None)
        if lead is None:
            return
        left = self._choices_of[lead]
        left.discard(rid)
        if not left:
            del self._choices_of[lead]
            if abort_prefill:
                self.scheduler.abort(lead)  # False when the prefill is done already

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[Req]:
        """One scheduled forward step; returns the requests that finished in it.

        An exception in the model, sampling or a stop checker does not escape: the requests of the
        step's batch end with finish_reason "error" (`req.error` says why), their pages are
        released, they are returned here, and the engine stays usable. KeyboardInterrupt (any
        BaseException) gets the same cleanup and then propagates."""
        t0 = time.monotonic()
        self._wait_for_grammars()
        try:
            done = self._overlap.step() if self._overlap is not None else self.scheduler.step(self.runner)
        except Exception as exc:
            self.last_error = exc
            done = self.scheduler.take_finished()
        finally:
            unrun = self.scheduler.take_unrun_loads()  # a failed step's host-tier loads
            if unrun:
                mover = self.runner.kv_mover
                if mover is None:
                    raise RuntimeError("the scheduler has host-tier KV loads but the runner has no host KV mover")
                for handle, pages in unrun:
                    mover.to_device(handle, pages)
            self.step_times.append((t0, time.monotonic()))
        for r in done:
            self._choice_ended(r.rid, abort_prefill=False)
        return done

    def _wait_for_grammars(self) -> None:
        """Requests whose grammar failed to compile end with an error; when nothing but compiling
        grammars is left to do, wait a little for one (instead of spinning)."""
        sched = self.scheduler
        for r in sched.gated_requests():
            if r.gate.done() and r.gate.exception() is not None:
                sched.fail_waiting(r, f"{GRAMMAR_FAILED}: {r.gate.exception()}")
        pending = sched.only_gated_work()
        if pending:
            concurrent.futures.wait(pending, timeout=0.05, return_when=concurrent.futures.FIRST_COMPLETED)

    # -- stop strings and text --------------------------------------------------------------------------
    def _stop_hit(self, req: Req) -> bool:
        stops = req.sampling.stop
        if not stops:
            return False
        tail = self.tokenizer.decode(req.output_ids[-(2 * max(map(len, stops)) + 8) :])
        return any(s in tail for s in stops)

    def final_text(self, req: Req) -> str:
        sp = req.sampling
        return final_text(
            self.tokenizer,
            req.output_ids,
            req.finish_reason.value if req.finish_reason else None,
            sp.stop,
            include_stop=sp.include_stop_str_in_output,
            skip_special_tokens=sp.skip_special_tokens,
        )

    def output_of(self, req: Req, index: int = 0, choice: int = 0) -> Output:
        t0 = req.arrival_time
        plp = req.prompt_logprobs if req.after is None else req.after.prompt_logprobs
        return Output(
            index=index,
            rid=req.rid,
            prompt_ids=list(req.prompt_ids),
            token_ids=list(req.output_ids),
            text=self.final_text(req),
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            error=req.error,
            ttft=None if req.first_token_time is None else req.first_token_time - t0,
            e2e_latency=None if req.finish_time is None else req.finish_time - t0,
            cached_tokens=req.cache_hit_tokens,
            num_retractions=req.num_retractions,
            choice=choice,
            logprobs=None if req.output_logprobs is None else list(req.output_logprobs),
            prompt_logprobs=None if plp is None else list(plp),
        )

    # -- batch APIs (engine/generate.py) --------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Prompt],
        sampling=None,
        *,
        chat: bool = False,
        n: int = 1,
        progress: Optional[Callable[[int, int], None]] = None,
    ) -> list[Output]:
        """Run every prompt to completion; one Output per prompt and choice, in order (prompt i's choice j
        at i * n + j; bad prompts carry `error`). `progress(done, total)` is called after each step. If the
        call is interrupted (Ctrl-C), its requests are aborted and their pages released first."""
        return generate(self, prompts, sampling, chat=chat, n=n, progress=progress)

    def stream(
        self, prompts: Sequence[Prompt], sampling=None, *, chat: bool = False, n: int = 1
    ) -> Iterator[StreamChunk]:
        """Yield new text per request as tokens arrive (after each step); a final chunk per request.
        Closing the iterator early (break, `close()`, garbage collection) aborts its requests."""
        return stream(self, prompts, sampling, chat=chat, n=n)
