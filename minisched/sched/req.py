"""Requests: `Req`, its status and finish reason (`SamplingParams` lives in sampling_params.py).

A request moves through

    WAITING -> PREFILLING -> RUNNING -> FINISHED
       ^          |  (chunked: stays PREFILLING over several rounds)
       +--- RETRACTED <-- RUNNING        (memory pressure; KV freed, back to the queue head)
    any live state -> ABORTED            (`Scheduler.abort`)
    WAITING -> FINISHED                  (ended by the scheduler's stall guard)

Pure Python: nothing here imports torch. Token bookkeeping (all in tokens):

- `prompt_ids`, `output_ids`; `fill_ids` = prompt + output (a new list: not for hot paths).
- `kv_len`: tokens whose K/V is in the pool; `page_ids[i]` holds tokens
  `[i*page_size, (i+1)*page_size)`; the first `n_cached_pages` pages are shared
  radix-cache pages locked through `last_node`, the rest are owned by the request.
- A RUNNING request always has `kv_len == seq_len - 1`: its last sampled token is
  the next decode step's input.
- `pending_ids` (launched steps, scheduler.py): placeholders (negative ids) for tokens
  that launched steps are still computing; they follow `output_ids` and count in
  `seq_len` and `fill_ids`, so the next step is scheduled as if they were known. Readers
  of the output (streams, stop checks) see only `output_ids`.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from minisched.base.values import cdiv, is_int
from minisched.sched.radix_cache import TreeNode
from minisched.sched.sampling_params import InvalidRequest, SamplingParams


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    RETRACTED = "retracted"  # transient: recorded in events, the request is WAITING again
    FINISHED = "finished"
    ABORTED = "aborted"


class Place(enum.Enum):
    """Which of the scheduler's queues holds a live request. The Scheduler changes it, with the
    status, in one place (`Scheduler._put` / `unlink`), so membership and status agree by construction."""

    NONE = "none"  # not queued: being admitted into this step's batch, or ended
    WAITING = "waiting"  # Scheduler.waiting (status WAITING)
    RUNNING = "running"  # Scheduler.running (status RUNNING)
    CHUNKED = "chunked"  # Scheduler.chunked_req, the carried chunked prefill (status PREFILLING)
    LIMBO = "limbo"  # InFlight.limbo: at its length limit, ending when its launched batch resolves


class FinishReason(enum.Enum):
    STOP_TOKEN = "stop_token"
    STOP_STR = "stop_str"
    MAX_NEW_TOKENS = "max_new_tokens"
    LENGTH = "length"  # the context or pool limit (max_new_tokens clipped on arrival), or max_new_tokens=0
    ABORT = "abort"
    ERROR = "error"  # the step computing it failed (an exception in the model, sampling, a stop checker)


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    pending_ids: list[int] = field(default_factory=list)  # placeholders of tokens still being computed
    status: ReqStatus = ReqStatus.WAITING
    place: Place = Place.NONE  # the scheduler's queue that holds it (changed only by the Scheduler)
    finish_reason: FinishReason | None = None
    # KV state
    kv_len: int = 0
    page_ids: list[int] = field(default_factory=list)
    n_cached_pages: int = 0  # leading page_ids shared with the radix cache (locked)
    last_node: TreeNode | None = None  # radix node whose path is locked for this request
    # scheduling state
    max_new_tokens: int = -1  # sampling.max_new_tokens clipped to the context and the pool (-1: unclipped)
    arrival_seq: int = 0  # order of arrival at the scheduler
    arrival_step: int = 0  # the scheduler's step count at arrival (priority aging)
    overtaken: int = 0  # prefill rounds that admitted a later arrival while this one waited (aging)
    num_retractions: int = 0
    cache_hit_tokens: int = 0  # prompt tokens reused from the radix cache at admission (device + host)
    host_hit_tokens: int = 0  # of those, the ones loaded back from the host tier
    error: str | None = None  # why it ended with FinishReason.ERROR
    # log-probabilities, when the sampling params ask for them (step_output.TokenLogprob)
    output_logprobs: list | None = None  # one per output token
    prompt_logprobs: list | None = None  # prompt positions from sampling.prompt_logprob_start (position 0: None)
    after: Req | None = None  # n > 1: the request prefilling the shared prompt; admitted once it has ended
    gate: Any = None  # a future (structured outputs: the compiling grammar); admitted once it is done
    gate_open: bool = False  # its gate was found done at the start of a build (Scheduler.get_next_batch)
    forks: int = 0  # n > 1 leader: its choices (forks.py)
    forked: bool = False  # n > 1 choice: it has copied (or given up) its leader's last page
    # timing (time.monotonic())
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            self.max_new_tokens = self.sampling.max_new_tokens
        sp = self.sampling
        if sp.logprobs is not None and self.output_logprobs is None:
            self.output_logprobs = []
        if (
            sp.prompt_logprobs is not None
            and self.prompt_logprobs is None
            and sp.prompt_logprob_start < self.prompt_len
        ):
            self.prompt_logprobs = [None] if sp.prompt_logprob_start == 0 else []

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + len(self.pending_ids)

    @property
    def fill_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids + self.pending_ids

    @property
    def logits_from(self) -> int | None:
        """The first position whose logits a prefill must still compute for prompt logprobs (they
        predict the token after it), or None. The radix-cache match stops there: cached K/V is
        reused, but logits are not cached."""
        if self.prompt_logprobs is None:
            return None
        nxt = self.sampling.prompt_logprob_start + len(self.prompt_logprobs)
        return nxt - 1 if nxt < self.prompt_len else None

    @property
    def ready(self) -> bool:
        """May it be admitted now (its shared prefill has ended, its grammar is compiled)? A grammar that
        failed is never ready: the engine ends the request before the next step (not a batch's matcher).
        A gate opens only at the start of a build, so one build sees one answer (and a replay the same)."""
        return (self.after is None or self.after.is_finished) and (self.gate is None or self.gate_open)

    @property
    def is_finished(self) -> bool:
        return self.status in (ReqStatus.FINISHED, ReqStatus.ABORTED)

    @property
    def remaining_new_tokens(self) -> int:
        return self.max_new_tokens - len(self.output_ids) - len(self.pending_ids)

    def check(self, page_size: int, max_context_len: int) -> None:
        """State/token-count consistency of a live request; raises AssertionError."""
        n_out = len(self.output_ids) + len(self.pending_ids)
        assert n_out <= self.max_new_tokens and self.seq_len <= max_context_len, (
            f"{self.rid}: too many tokens ({len(self.output_ids)} out, {self.seq_len} total)"
        )
        assert len(self.page_ids) == cdiv(self.kv_len, page_size), (
            f"{self.rid}: {len(self.page_ids)} pages for kv_len {self.kv_len}"
        )
        if self.status is ReqStatus.WAITING:
            assert self.kv_len == 0 and self.last_node is None, f"{self.rid}: waiting request holds KV"
        elif self.status is ReqStatus.RUNNING:
            assert self.kv_len == self.seq_len - 1, f"{self.rid}: running, kv_len {self.kv_len}, seq_len {self.seq_len}"
        else:
            assert 0 < self.kv_len < self.seq_len, (
                f"{self.rid}: prefilling, kv_len {self.kv_len}, seq_len {self.seq_len}"
            )
        assert self.n_cached_pages <= self.kv_len // page_size, f"{self.rid}: shares a partly filled page"
        assert self.last_node is not None or self.n_cached_pages == 0, f"{self.rid}: shared pages without a lock"

    def token_at(self, pos: int) -> int:
        n = len(self.prompt_ids)
        if pos < n:
            return self.prompt_ids[pos]
        m = len(self.output_ids)
        return self.output_ids[pos - n] if pos - n < m else self.pending_ids[pos - n - m]


def new_request(
    rid: str, prompt_ids: Iterable[int], sampling: SamplingParams | dict | None, max_context_len: int, pool_tokens: int
) -> Req:
    """Validate a new request; raises InvalidRequest (a ValueError) naming the problem.

    `max_new_tokens` is clipped (SGLang clips on arrival too) so that the request fits both
    the context and the whole pool on its own: its last token is sampled, never stored, so
    it needs at most `prompt + max_new - 1` tokens of KV. Without the pool bound a request
    could outgrow the pool while other requests share its pages and wait forever."""
    sampling = SamplingParams() if sampling is None else sampling
    if isinstance(sampling, dict):
        sampling = SamplingParams(**sampling)
    if not isinstance(sampling, SamplingParams):
        raise InvalidRequest(f"request {rid!r}: sampling must be SamplingParams, got {type(sampling).__name__}")
    if not isinstance(rid, str) or not rid:
        raise InvalidRequest(f"request id must be a non-empty str, got {rid!r}")
    prompt = list(prompt_ids)
    if not prompt:
        raise InvalidRequest(f"request {rid!r}: empty prompt")
    if not all(is_int(t) and t >= 0 for t in prompt):
        raise InvalidRequest(f"request {rid!r}: prompt ids must be non-negative ints")
    prompt = [int(t) for t in prompt]
    if len(prompt) >= max_context_len:
        raise InvalidRequest(
            f"request {rid!r}: prompt of {len(prompt)} tokens leaves no room to generate "
            f"within max_context_len={max_context_len}"
        )
    if len(prompt) > pool_tokens:
        raise InvalidRequest(
            f"request {rid!r}: prompt of {len(prompt)} tokens exceeds the whole KV pool ({pool_tokens} tokens)"
        )
    max_new = min(sampling.max_new_tokens, max_context_len - len(prompt), pool_tokens + 1 - len(prompt))
    return Req(rid=rid, prompt_ids=prompt, sampling=sampling, max_new_tokens=max_new)


def finish_reason(req: Req, max_context_len: int, stop_checker: Callable[[Req], bool] | None) -> FinishReason | None:
    """Why `req` ends after its newest token, or None: stop token, the length limits, then the
    engine's stop checker (which may raise: that ends this request with ERROR, not the batch)."""
    sp = req.sampling
    if not sp.ignore_eos and req.output_ids[-1] in sp.stop_token_ids:
        return FinishReason.STOP_TOKEN
    if len(req.output_ids) >= req.max_new_tokens:  # the clip (context or pool) is a LENGTH end
        return FinishReason.MAX_NEW_TOKENS if len(req.output_ids) >= sp.max_new_tokens else FinishReason.LENGTH
    if req.prompt_len + len(req.output_ids) >= max_context_len:  # (not counting placeholders)
        return FinishReason.LENGTH
    if stop_checker is not None:
        try:
            hit = stop_checker(req)
        except Exception as exc:  # a broken checker ends this request, not the batch
            req.error = f"stop checker failed: {type(exc).__name__}: {exc}"
            return FinishReason.ERROR
        if hit:
            return FinishReason.STOP_STR
    return None
