"""Overlap scheduling (SGLang's "zero-overhead" scheduler): the scheduler's half.

The engine builds step N+1 while step N's forward runs. For that, `launch(batch)` advances
the scheduler's state as if the batch's sampled tokens were already known:

- every row's `kv_len` becomes `prefix + extend` (its K/V is being written);
- each sampled row gets a placeholder token, a negative "future id" (`batch.future_ids`),
  appended to `req.pending_ids`: the next step's input for that request is the placeholder,
  which the runner swaps for the real token before its forward reads it;
- a prompt that completes joins `running` at once; a request whose placeholder reaches its
  length limit (`max_new_tokens`, the context) is held back (`limbo`), so it is never
  scheduled past its end.

`resolve(batch, tokens)` then, one step late, replaces the placeholders by the sampled tokens
in order, runs the data-dependent finish checks (stop token, stop string) and releases what
ended. A request found finished there may already sit in the next launched batch: that
extra token is discarded, and the request gives back its KV as of the resolved step
(`kv_len` cut to the tokens written by resolved steps), so the radix cache and the pool end
exactly as without overlap.

Rules that keep every page and cache entry valid even if a launched step fails:
- the radix cache only learns pages written by resolved steps (`cache_unfinished_req` with
  the resolved length); releases cut `kv_len` to the committed length (`committed_len`);
- no retraction while a batch is launched (`get_next_batch` waits for it instead), so a
  retracted request never has placeholders;
- an abort releases at once with the committed length; the launched row is then dead and
  skipped at resolve. Pages freed under a running forward are only handed to later steps,
  whose forwards run after it (one worker, in order);
- `fail_launched` ends every request of every launched batch with an error.

Pure Python, no torch.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

from minisched.sched.batch import Batch
from minisched.sched.req import FinishReason, Req, ReqStatus, finish_reason

if TYPE_CHECKING:
    from minisched.sched.scheduler import Scheduler


def committed_len(sched: Scheduler, req: Req) -> int:
    """Tokens of `req` whose K/V was written by resolved steps: its prefix in the oldest
    launched batch that holds it, else its `kv_len`."""
    for batch in sched._launched:
        for r, p in zip(batch.reqs, batch.prefix_lens):
            if r is req:
                return p
    return req.kv_len


def launch(sched: Scheduler, batch: Batch) -> None:
    """The batch from the last `get_next_batch` goes to the forward worker; advance the state."""
    if batch is not sched._in_flight:
        raise RuntimeError("launch: not the batch returned by the last get_next_batch")
    sched._in_flight = None
    sched._launched.append(batch)
    max_ctx, limbo, running = sched.config.max_context_len, sched._limbo, sched.running
    futures = []
    for req, p, e, sampled in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, batch.sampled):
        req.kv_len = p + e
        if not sampled:  # a chunk that does not finish its prompt: it stays the carried request
            futures.append(0)
            continue
        sched._next_future += 1
        fid = -sched._next_future
        futures.append(fid)
        if req.max_new_tokens == 0:  # prefill only: ends at resolve, without a token
            limbo.append(req)
            continue
        req.pending_ids.append(fid)
        done = len(req.output_ids) + len(req.pending_ids) >= req.max_new_tokens or p + e + 1 >= max_ctx
        if req.status is ReqStatus.PREFILLING:
            sched._set_status(req, ReqStatus.RUNNING)
            (limbo if done else running).append(req)
        elif done:
            running.remove(req)
            limbo.append(req)
    batch.future_ids = futures


def resolve(sched: Scheduler, batch: Batch, next_token_ids: Sequence[int]) -> list[Req]:
    """The oldest launched batch's sampled tokens (batch order) arrived: apply them; returns the
    requests that finished (and any that ended early, as `process_batch_result` does)."""
    if not sched._launched or batch is not sched._launched[0]:
        raise RuntimeError("resolve: not the oldest launched batch")
    if len(next_token_ids) != len(batch.reqs):
        raise ValueError(f"expected {len(batch.reqs)} tokens, got {len(next_token_ids)}")
    finished, sched._finished_early = sched._finished_early, []
    try:
        _apply(sched, batch, next_token_ids, finished)
    except BaseException as exc:  # e.g. Ctrl-C in a stop checker
        sched._finished_early = finished + fail_launched(sched, f"{type(exc).__name__}: {exc}")
        raise
    sched._launched.pop(0)
    return finished


def _apply(sched: Scheduler, batch: Batch, next_token_ids: Sequence[int], finished: list[Req]) -> None:
    running, prefilling = ReqStatus.RUNNING, ReqStatus.PREFILLING
    first_decode = batch.batch_size - batch.num_decode
    checker = sched.stop_checker
    for b, (req, p, e, sampled, fid, tok) in enumerate(zip(batch.reqs, batch.prefix_lens, batch.extend_lens,
                                                         batch.sampled, batch.future_ids, next_token_ids)):
        if req.status is not running and req.status is not prefilling:
            continue  # released while launched (abort, or finished by an earlier resolve): discarded
        valid = p + e
        if not sampled:
            sched._cache_unfinished(req, valid)
            continue
        if req.max_new_tokens == 0:
            _end(sched, req, valid, FinishReason.LENGTH)
            finished.append(req)
            continue
        if not req.pending_ids or req.pending_ids[0] != fid:
            raise RuntimeError(f"{req.rid}: placeholder {fid} is not the oldest pending token")
        tok = int(tok)
        req.pending_ids.pop(0)
        req.output_ids.append(tok)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if (len(req.output_ids) >= req.max_new_tokens or valid + 1 >= sched.config.max_context_len
                or checker is not None or tok in req.sampling.stop_token_ids):
            reason = finish_reason(req, sched.config.max_context_len, checker)
            if reason is not None:
                _end(sched, req, valid, reason)
                finished.append(req)
                continue
        if not req.pending_ids and req in sched._limbo:
            raise RuntimeError(f"{req.rid}: held back at its length limit but not finished")
        if b < first_decode:  # its prompt completed in this batch: share its pages
            sched._cache_unfinished(req, valid)


def _end(sched: Scheduler, req: Req, valid: int, reason: FinishReason) -> None:
    """Release with the K/V of the resolved steps only; a token of a later launched step is dropped."""
    sched._unlink(req)
    req.pending_ids.clear()
    req.kv_len = valid
    sched._release(req, ReqStatus.FINISHED, reason)


def abort_launched(sched: Scheduler, req: Req) -> None:
    """Abort a live request between steps in overlap mode: release now, with its committed KV."""
    valid = committed_len(sched, req)
    sched._unlink(req)
    req.pending_ids.clear()
    req.kv_len = valid
    sched._release(req, ReqStatus.ABORTED, FinishReason.ABORT)


def fail_launched(sched: Scheduler, message: str) -> list[Req]:
    """A launched step failed (or the loop was interrupted): every live request of every launched
    batch, and of a batch built but not launched, ends with FinishReason.ERROR and gives back its
    KV as of the resolved steps. The caller must let the worker finish what it runs (its results
    are dropped). Returns the failed requests, also reported by `take_finished()`."""
    batches = sched._launched + ([sched._in_flight] if sched._in_flight is not None else [])
    valid: dict[int, int] = {}
    for batch in batches:
        for r, p in zip(batch.reqs, batch.prefix_lens):
            valid.setdefault(id(r), p)
    sched._launched, sched._in_flight = [], None
    sched._abort_pending.clear()
    failed, sched._finished_early = sched._finished_early, []
    for batch in batches:
        for req in batch.reqs:
            if req.status not in (ReqStatus.RUNNING, ReqStatus.PREFILLING) or sched.reqs.get(req.rid) is not req:
                continue
            sched._unlink(req)
            req.pending_ids.clear()
            req.kv_len = valid[id(req)]
            req.error = message
            sched._release(req, ReqStatus.FINISHED, FinishReason.ERROR)
            failed.append(req)
    sched._limbo.clear()
    sched._finished_early = failed
    return failed
