"""The HTTP side's state: one `ServerState` per server, one `RequestHandle` per live request.

Everything here is touched only by the server's asyncio event loop (the engine thread reaches
a handle only through `EngineLoop` publishing to `RequestHandle.deliver` with
`call_soon_threadsafe`), so nothing needs a lock.

Admission, in order: the request's bounds (limits.py) and prompt and sampling checks (entry.py,
before `admit`) -> 400; then in `admit`: draining -> 503; more than `limits.max_queued_requests`
requests queued with this call's choices (prompts x n) -> 429 with Retry-After. A choice counts as queued from its admission
until its first token (or its end); one that already streams does not. Each admitted request is in `live` until its finish arrives from the engine.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Optional

from minisched.sched.sampling_params import SamplingParams
from minisched.serve import request_id
from minisched.serve.limits import ServerLimits
from minisched.serve.loop import ServingLoop
from minisched.serve.messages import Sink, Update
from minisched.serve.metrics import ServerMetrics
from minisched.serve.protocol import APIError

OPENAI_FINISH = {
    "stop_token": "stop",
    "stop_str": "stop",
    "max_new_tokens": "length",
    "length": "length",
    "abort": "abort",
    "error": "error",
}
log = logging.getLogger("minisched.serve")
RECENT_IDS = 4096  # client request ids remembered for /debug/requests/{id}


@dataclass(frozen=True)
class Prepared:
    prompt_ids: list[int]
    sampling: SamplingParams


class RequestHandle:
    """One request (one choice of one prompt) on the HTTP side: its timings, and the call's queue
    its engine updates land in, tagged with the choice's `index` in the response."""

    def __init__(
        self, state: ServerState, rid: str, prompt_len: int, index: int = 0, queue: Optional[asyncio.Queue] = None
    ):
        self.state, self.rid, self.prompt_len, self.index = state, rid, prompt_len, index
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, Update]] = queue if queue is not None else asyncio.Queue()
        self.arrival = time.monotonic()
        self.created = int(time.time())
        self.first_token_at: Optional[float] = None
        self.num_tokens = 0
        self.final: Optional[Update] = None  # the finishing update, once it arrived
        self.queued = True
        # for the logs: the client's id (request_id.py), else the call's
        self.request_id = request_id.current() or rid.rsplit("-", 1)[0]

    # called on the event loop by the engine thread's publish
    def deliver(self, upd: Update) -> None:
        now = time.monotonic()
        if upd.token_ids and self.first_token_at is None:
            self.first_token_at = now
        self.num_tokens += len(upd.token_ids)
        if self.queued and (upd.token_ids or upd.finish_reason):
            self.queued = False
            self.state.queued -= 1
        if upd.finish_reason is not None:
            self.final = upd
            self.state.request_done(self, now)
        self.queue.put_nowait((self.index, upd))

    @property
    def finished(self) -> bool:
        return self.final is not None

    def abort_unless_finished(self) -> None:
        """The client went away (or the response ended early): release the request in the engine."""
        if self.final is None:
            self.state.engine_loop.abort(self.rid)


class Call:
    """One API call's requests: its prompts x n choices, handle i answering choice `index` i. Their
    updates share one queue, so a stream interleaves choices as their tokens come."""

    def __init__(self, handles: list[RequestHandle], queue: asyncio.Queue):
        self.handles, self.queue = handles, queue
        self.rid = handles[0].rid.rsplit("-", 1)[0]  # the call's id: the handles are <id>-<index>
        self.created = handles[0].created

    async def updates(self) -> AsyncIterator[tuple[int, Update]]:
        """(choice index, update) until every choice has finished; a backlog of one choice's
        running updates is merged into one."""
        left, held = len(self.handles), None  # held: another choice's update, taken while merging
        while left:
            i, upd = held if held is not None else await self.queue.get()
            held = None
            while upd.finish_reason is None and not self.queue.empty():
                j, nxt = self.queue.get_nowait()
                if j != i:  # merge only the same choice's updates
                    held = (j, nxt)
                    break
                upd = upd.merged(nxt)
            if upd.finish_reason is not None:
                left -= 1
            yield i, upd

    def abort_unfinished(self) -> None:
        for h in self.handles:
            h.abort_unless_finished()


class ServerState:
    def __init__(
        self,
        engine,
        engine_loop: ServingLoop,
        *,
        model_name: str,
        api_key: Optional[str] = None,
        limits: ServerLimits = ServerLimits(),
    ):
        self.engine_loop = engine_loop
        self.tokenizer = engine.tokenizer
        self.model_config = engine.cfg  # the model's family and shapes (/model_info); frozen
        self.vocab_size = engine.cfg.vocab_size
        cfg = self.sched_config = engine.sched_config  # frozen: safe to read from this thread
        self.max_context_len = cfg.max_context_len
        self.pool_tokens = cfg.num_pages * cfg.page_size
        self.model_name, self.api_key = model_name, api_key
        self.limits = limits
        self.created = int(time.time())
        self.metrics = ServerMetrics(lambda: engine_loop.stats)
        self.live: dict[str, RequestHandle] = {}
        self.queued = 0
        self.draining = False
        self._e2e_sum, self._e2e_count = 0.0, 0
        self._ids = itertools.count()
        self._call_ids: collections.OrderedDict[str, str] = collections.OrderedDict()  # client id -> call id
        self._prefix = uuid.uuid4().hex[:12]

    # -- admission ------------------------------------------------------------------------------
    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                param="model",
                code="model_not_found",
            )

    def admit(self, prompts: list[Prepared], kind: str, n: int = 1) -> Call:
        """Hand a call's prompts (x n choices each) to the engine: one request per choice, ids
        `<call id>-<index>`, index = prompt * n + choice (the response's order)."""
        if self.draining:
            raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
        if not self.engine_loop.is_alive():
            raise APIError(503, "the engine is not running", type="server_error", code="engine_stopped")
        choices = len(prompts) * n
        if self.queued + choices > self.limits.max_queued_requests:  # each choice is a request in the engine
            self.metrics.rejected.labels("queue_full").inc()
            raise APIError(
                429,
                f"too many queued requests ({self.queued} queued, this request adds {choices}, "
                f"at most {self.limits.max_queued_requests}); retry later",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(self.retry_after())},
            )
        call_id = f"{kind}-{self._prefix}{next(self._ids):x}"
        log.info(
            "admitted %s: %d prompt(s) x %d, %s prompt tokens",
            call_id,
            len(prompts),
            n,
            "/".join(str(len(p.prompt_ids)) for p in prompts[:8]) + ("/..." if len(prompts) > 8 else ""),
            extra={"request_id": request_id.current() or call_id},
        )
        client_id = request_id.current()
        if client_id and client_id != call_id:  # GET /debug/requests/{id} takes the client's id too
            self._call_ids[client_id] = call_id
            while len(self._call_ids) > RECENT_IDS:
                self._call_ids.popitem(last=False)
        queue: asyncio.Queue = asyncio.Queue()
        handles = []
        for p, prepared in enumerate(prompts):
            mine = [
                RequestHandle(self, f"{call_id}-{p * n + j}", len(prepared.prompt_ids), p * n + j, queue)
                for j in range(n)
            ]
            for h in mine:
                self.live[h.rid] = h
            self.queued += n
            sinks: list[Sink] = list(mine)  # submit's list is of Sinks (a list is invariant)
            self.engine_loop.submit([h.rid for h in mine], prepared.prompt_ids, prepared.sampling, sinks, client_id)
            handles += mine
        return Call(handles, queue)

    def call_id_of(self, rid: str) -> str:
        """The call id of a recent request named by the client's id, else `rid` itself."""
        return self._call_ids.get(rid, rid)

    def retry_after(self) -> int:
        """Seconds until the queue has likely moved on: one mean e2e latency, at least 1 s."""
        mean = self._e2e_sum / self._e2e_count if self._e2e_count else 1.0
        return max(1, min(60, math.ceil(mean)))

    def request_done(self, handle: RequestHandle, now: float) -> None:
        self.live.pop(handle.rid, None)
        upd = handle.final
        if upd is None or upd.finish_reason is None:
            raise RuntimeError(f"request_done({handle.rid}) before its finishing update")
        reason = upd.finish_reason
        ttft = None if handle.first_token_at is None else handle.first_token_at - handle.arrival
        self._e2e_sum += now - handle.arrival
        self._e2e_count += 1
        log.info(
            "finished %s: %s, %d prompt tokens (%d cached), %d output tokens, %.3f s",
            handle.rid,
            reason,
            handle.prompt_len,
            upd.cached_tokens,
            handle.num_tokens,
            now - handle.arrival,
            extra={"request_id": handle.request_id},
        )
        self.metrics.request_done(
            finish_reason=OPENAI_FINISH.get(reason, reason),
            prompt_tokens=handle.prompt_len,
            cached_tokens=upd.cached_tokens,
            output_tokens=handle.num_tokens,
            ttft=ttft,
            e2e=now - handle.arrival,
            first_token_at=handle.first_token_at,
            done_at=now,
        )

    # -- shutdown -------------------------------------------------------------------------------
    async def drain(self, grace: float) -> int:
        """Refuse new requests, let live ones finish for `grace` seconds, then abort the rest and
        wait (briefly) for their abort to arrive. Returns how many were aborted."""
        self.draining = True
        deadline = time.monotonic() + grace
        while self.live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        aborted = list(self.live)
        for rid in aborted:
            self.engine_loop.abort(rid)
        deadline = time.monotonic() + 5.0
        while self.live and time.monotonic() < deadline and self.engine_loop.is_alive():
            await asyncio.sleep(0.02)
        return len(aborted)
