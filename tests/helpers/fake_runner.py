"""A deterministic fake model runner and helpers for the scheduler tests (no torch).

`FakeRunner` behaves like the engine: it stores each new token (and its position) in a
fake KV pool at `batch.out_slots()`, then reads every request's whole history back
through `batch.page_table()` and checks it against the request's tokens. Its "greedy"
next token is a hash of the history it read, so any page-table, sharing or eviction bug
either trips an assertion or changes the outputs. A verify row (speculative decoding) is
checked against its drafts too and answered with its greedy accepted run; `OracleDrafter`
drafts the fake model's true continuation with some tokens wrong, so every acceptance length
occurs.
"""

from __future__ import annotations

import numpy as np

from minisched.sched.batch import Batch
from minisched.sched.events import Event
from minisched.sched.req import ReqStatus
from minisched.sched.scheduler import Scheduler
from minisched.sched.spec import accept_greedy
from minisched.sched.step_output import StepOutput


def next_token(history: list[int] | np.ndarray, vocab: int) -> int:
    h = np.asarray(history, dtype=np.int64)
    return int((int(h.sum()) * 7 + int(h[-1]) * 13 + len(h) * 5) % vocab)


def greedy_reference(prompt: list[int], max_new: int, vocab: int, stop_ids=(), max_len: int | None = None) -> list[int]:
    """What an unconstrained run must produce for one request."""
    seq, out = list(prompt), []
    while True:
        t = next_token(seq, vocab)
        out.append(t)
        seq.append(t)
        if t in stop_ids or len(out) >= max_new or (max_len is not None and len(seq) >= max_len):
            return out


class FakeRunner:
    def __init__(self, num_pages: int, page_size: int, vocab: int = 50) -> None:
        self.ps, self.vocab = page_size, vocab
        self.tok = np.full(num_pages * page_size, -1, dtype=np.int64)
        self.pos = np.full(num_pages * page_size, -1, dtype=np.int64)
        self.num_forward = 0
        self.mover = FakeMover(self)

    def forward(self, batch: Batch) -> list[int]:
        self.num_forward += 1
        for handle, pages in batch.loads:  # host-tier hits come back before the forward reads them
            self.mover.to_device(handle, pages)
        for src, dst in batch.copies:  # copy-on-write of a forked prompt's last page
            s, d = self.mover.slots([src]), self.mover.slots([dst])
            self.tok[d], self.pos[d] = self.tok[s], self.pos[s]
        ps, n = self.ps, batch.num_tokens
        ids, pos, slots = batch.input_ids(), batch.positions(), batch.out_slots()
        assert len(ids) == len(pos) == len(slots) == n and n > 0
        assert ids.dtype == pos.dtype == slots.dtype == np.int32
        assert len(np.unique(slots)) == n, "two new tokens share a slot"
        self.tok[slots], self.pos[slots] = ids, pos
        indptr, indices, last = batch.page_table()
        qo, li = batch.qo_indptr(), batch.logits_indices()
        assert qo[-1] == n and np.array_equal(li, qo[1:] - 1)
        assert ((last >= 1) & (last <= ps)).all()
        out, more = [], []
        drafts = batch.drafts or [[]] * len(batch.reqs)
        for b, (req, d) in enumerate(zip(batch.reqs, drafts)):
            pages = indices[indptr[b] : indptr[b + 1]].astype(np.int64)
            kv_len = (len(pages) - 1) * ps + int(last[b])
            assert kv_len == batch.prefix_lens[b] + batch.extend_lens[b]
            kv_slots = (pages[:, None] * ps + np.arange(ps)).ravel()[:kv_len]
            assert np.array_equal(self.pos[kv_slots], np.arange(kv_len)), f"{req.rid}: KV positions wrong"
            hist = self.tok[kv_slots]
            want = [req.token_at(i) for i in range(kv_len - len(d))] + list(d)  # a verify row: then its drafts
            assert hist.tolist() == want, f"{req.rid}: KV content differs from the request's tokens"
            # a verify row: the target's token after each prefix (greedy acceptance, as the engine's runner)
            targets = [next_token(hist[: kv_len - len(d) + i], self.vocab) for i in range(len(d) + 1)]
            run = accept_greedy(d, targets)
            out.append(run[0])
            more.append(run[1:])
        return StepOutput(out, more_tokens=more) if batch.drafts else out


class FakeMover:
    """The host tier's mover for the fake KV: copies a page's (token, position) slots out and back. With
    `poison_freed`, a reallocated page's slots are garbage, so a forgotten or misplaced load fails the runner's check."""

    def __init__(self, runner: FakeRunner) -> None:
        self.runner = runner
        self.to_host_calls = self.to_device_calls = 0

    def slots(self, pages: list[int]) -> np.ndarray:
        ps = self.runner.ps
        return (np.asarray(pages, dtype=np.int64)[:, None] * ps + np.arange(ps)).ravel()

    def to_host(self, pages: list[int]):
        self.to_host_calls += 1
        s, r = self.slots(pages), self.runner
        return r.tok[s].copy(), r.pos[s].copy()

    def to_device(self, handle, pages: list[int]) -> None:
        self.to_device_calls += 1
        s, r = self.slots(pages), self.runner
        assert len(s) == len(handle[0]), "a load of the wrong size"
        r.tok[s], r.pos[s] = handle

    def split(self, handle, n_pages: int):
        k = n_pages * self.runner.ps
        return (handle[0][:k], handle[1][:k]), (handle[0][k:], handle[1][k:])

    def free(self, handle) -> None:
        pass


def poison_freed(sched: Scheduler, runner: FakeRunner) -> None:
    """Make every page the pool hands out again garbage in the fake KV (as a real pool's reused pages are):
    a page read before its new owner wrote it -- a skipped load or copy, a use after free -- fails the check."""
    alloc = sched.pool.alloc

    def poisoning_alloc(n):
        pages = alloc(n)
        if pages:
            s = runner.mover.slots(pages)
            runner.tok[s], runner.pos[s] = -7, -7
        return pages

    sched.pool.alloc = poisoning_alloc


def run(sched: Scheduler, runner: FakeRunner, max_steps: int = 10_000, check: bool = True) -> dict:
    """Step until no work is left, checking invariants after every step; rid -> Req."""
    done = {}
    for _ in range(max_steps):
        if not sched.has_work():
            break
        for req in sched.step(runner):
            assert req.rid not in done, f"{req.rid} finished twice"
            done[req.rid] = req
        if check:
            sched.check_invariants()
    else:
        raise AssertionError(f"no progress after {max_steps} steps")
    return done


def check_lifecycles(events: list[Event]) -> None:
    """Every request's event chain is a legal path ending at most once in a final state."""
    legal = {
        (None, ReqStatus.WAITING),
        (ReqStatus.WAITING, ReqStatus.PREFILLING),
        (ReqStatus.PREFILLING, ReqStatus.RUNNING),
        (ReqStatus.PREFILLING, ReqStatus.FINISHED),
        (ReqStatus.RUNNING, ReqStatus.FINISHED),
        (ReqStatus.RUNNING, ReqStatus.RETRACTED),
        (ReqStatus.PREFILLING, ReqStatus.RETRACTED),
        (ReqStatus.RETRACTED, ReqStatus.WAITING),
        (ReqStatus.WAITING, ReqStatus.ABORTED),
        (ReqStatus.PREFILLING, ReqStatus.ABORTED),
        (ReqStatus.RUNNING, ReqStatus.ABORTED),
        (ReqStatus.WAITING, ReqStatus.FINISHED),  # failed by the stall guard
    }
    state: dict[int, ReqStatus | None] = {}
    rid_gen: dict[str, int] = {}
    for e in events:
        if e.src is None:  # a (possibly reused) rid starts a new life
            rid_gen[e.rid] = rid_gen.get(e.rid, 0) + 1
        key = hash((e.rid, rid_gen[e.rid]))
        assert (e.src, e.dst) in legal, f"{e.rid}: illegal {e.src} -> {e.dst}"
        assert state.get(key) == e.src, f"{e.rid}: event from {e.src} but was {state.get(key)}"
        assert state.get(key) not in (ReqStatus.FINISHED, ReqStatus.ABORTED)
        state[key] = e.dst


class OracleDrafter:
    """Drafts for the fake model: its greedy continuation of the request's verified tokens, with the draft
    at position i wrong when `(seq_len + i) % wrong_every == 0` (0: never), so partial, full and empty
    acceptances all occur, deterministically."""

    def __init__(self, vocab: int, wrong_every: int = 5) -> None:
        self.vocab, self.wrong_every = vocab, wrong_every
        self.calls = 0

    def propose(self, reqs, ks) -> list[list[int]]:
        self.calls += 1
        out = []
        for r, k in zip(reqs, ks):
            seq, d = list(r.prompt_ids) + list(r.output_ids), []
            for i in range(k):
                t = next_token(seq, self.vocab)
                if self.wrong_every and (len(seq) + i) % self.wrong_every == 0:
                    t = (t + 1) % self.vocab
                d.append(t)
                seq.append(t)
            out.append(d)
        return out
