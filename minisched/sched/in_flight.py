"""`InFlight`: the batches between `get_next_batch` and the application of their tokens.

A batch is *built* (returned by `get_next_batch`), then *launched* (the scheduler's state is
advanced with placeholder tokens while its forward runs), then *resolved* (its sampled tokens
replace the placeholders). The plain step launches and resolves at once; overlap scheduling
keeps one batch launched while the next is built. Both go through the same three calls.

This class only keeps that bookkeeping; the Scheduler changes request state. Pure Python.
"""

from __future__ import annotations

from minisched.sched.batch import Batch
from minisched.sched.req import Req


class InFlight:
    def __init__(self) -> None:
        self.built: Batch | None = None  # returned by get_next_batch, not launched yet
        self.launched: list[Batch] = []  # computing; tokens not applied yet (oldest first)
        self.limbo: list[Req] = []  # live, at their length limit, ending when their batch resolves
        self.aborted: set[int] = set()  # id(req) of rows of `built` aborted before launch
        self._futures = 0  # placeholder token ids are -1, -2, ...

    @property
    def busy(self) -> bool:
        """A batch is built or launched."""
        return self.built is not None or bool(self.launched)

    def next_future(self) -> int:
        self._futures += 1
        return -self._futures

    def in_built(self, req: Req) -> bool:
        return self.built is not None and any(r is req for r in self.built.reqs)

    def committed_len(self, req: Req) -> int:
        """Tokens of `req` whose K/V was written by resolved steps: its prefix in the oldest
        launched batch that holds it, else its `kv_len`."""
        for batch in self.launched:
            for r, p in zip(batch.reqs, batch.prefix_lens):
                if r is req:
                    return min(p, req.kv_len)  # (a request retracted while launched holds nothing)
        return req.kv_len

    def launched_rows(self) -> set[int]:
        """id() of every request with a row in a launched batch (one preempted there waits for it)."""
        return {id(r) for b in self.launched for r in b.reqs}

    def future_ids(self) -> set[int]:
        return {f for b in self.launched for f in (*b.future_ids, *b.draft_futures) if f < 0}

    def take_all(self) -> list[Batch]:
        """Every launched batch (oldest first) and the built one; the bookkeeping is cleared."""
        batches = self.launched + ([self.built] if self.built is not None else [])
        self.built, self.launched = None, []
        self.aborted.clear()
        return batches
