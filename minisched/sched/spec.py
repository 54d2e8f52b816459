"""Speculative decoding, the scheduler's half: drafters, the draft plan of a step, acceptance bookkeeping.

A decode step with drafts is a VERIFY batch (batch.py): running request b feeds its last token
and `k_b` draft tokens (`qo_len = k_b + 1`, the rows of a prefill extend: the paged prefill
kernel's bottom-right causal rule gives draft i the K/V of the tokens before it), and the
runner returns, per row, the accepted run: the longest prefix of drafts equal to what the target
produces at those positions, plus the target's next token (the bonus, or the correction). Greedy
rows compare with the argmax; sampled rows use the rejection rule (model/sampling.py,
`verify_drafts`), so outputs keep the target's distribution. The scheduler (scheduler.py) applies
the run token by token, with stop checks after each, so a stop inside the run ends the request
there; only verified tokens reach `output_ids`, streams and the radix cache. Logprobs of an
accepted run are read from the target's logits at its positions (`StepOutput.more_logprobs`).

- Drafters (the `Drafter` protocol): a draft model (engine/draft.py, torch) or
  `NgramDrafter` (prompt lookup, vLLM's `ngram` / SGLang's NGRAM): the longest suffix of the
  request's prompt + output, `max_match` tokens down to `min_match`, that occurred before; the
  tokens that followed its most recent occurrence are the draft. An index per request
  (n-gram -> position after it) is extended by the new tokens only, so a step costs O(new).
- `Speculator`: which requests may draft how many tokens this step (`lengths`), the drafts
  (`propose`, once their pages are allocated) and what they accepted (`observe`). Limits: no drafting above `spec_max_batch_size` running requests (a large batch is
  compute-bound: drafts cost more than they save); a request drafts only if its sampling allows
  it (`SamplingParams.can_draft`: no grammar, penalties, bias or min_tokens) and at
  most `remaining - 1` tokens and what its context leaves, so a fully accepted run never
  overshoots. Adaptive draft length (SGLang's adaptive speculation, per request): after a verify
  that accepted `a` of `d` drafts the next draft length is `a + 1` (all accepted: one more, up to
  `num_draft_tokens`); two verifies in a row that accept nothing turn the request's drafting off
  for 8 steps, doubling up to 256 while it keeps failing. Drafts that do not fit the pool are cut.
- Does it pay (`worth`, spec_cost.py)? The proposed drafts are cut to what a step-cost model fitted
  on the machine's own decode and verify steps expects to pay for, from each request's running
  acceptance estimate: at one stream on a CPU extra rows are almost free, at eight they are not.
- Pages: a verify row needs pages for `kv_len + 1 + k_b` tokens (whole pages, from the free list,
  evicting the radix cache if needed; never a retraction), allocated before drafting (a draft
  model writes its K/V there; pages a shorter draft does not need go back at once). After the
  verify the pages past the accepted length go back to the pool; rejected drafts' K/V in the last kept page is overwritten
  by the next step before anything reads it, and that page is never full of verified tokens
  until it is, so the radix cache never holds an unverified token.
- Overlap (engine/overlap.py): a verify step is resolved before the next step is built -- its
  accepted lengths decide the next step's positions, and drafting reads the real last tokens.
  `get_next_batch` returns None while a verify batch is launched; a plain decode launched with
  requests that drafted well recently (or every 32nd step, to probe) is drained the same way
  first. Overlap keeps working for the steps that do not draft.

Pure Python.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from minisched.sched.req import Req
from minisched.sched.spec_cost import StepCost, choose

SPECULATIVE = ("ngram", "draft")  # prompt lookup here; a draft model: engine/draft.py
MISSES_TO_PAUSE = 2  # verifies in a row that accept nothing before a request stops drafting for a while
PAUSE_STEPS, MAX_PAUSE_STEPS = 8, 256
PROBE_EVERY = 32  # overlap: a plain decode is drained this often to let drafting try again; the cost model
# keeps every draft of such a step, so acceptance and the verify rows' cost keep being measured
EWMA = 0.25  # how fast an acceptance estimate forgets older verifies
PRIOR_ACCEPTANCE = 0.5  # before any verify: a draft token kept half the time


class Drafter(Protocol):
    def propose(self, reqs: Sequence[Req], ks: Sequence[int]) -> list[list[int]]:
        """At most ks[i] draft tokens continuing reqs[i]'s prompt + output (ks[i] >= 1); each request's
        pages already hold room for them (engine/draft.py's drafter writes its own K/V there)."""
        ...


class NgramDrafter:
    """Prompt lookup: the tokens after the most recent earlier occurrence of the longest suffix n-gram."""

    def __init__(self, min_match: int = 2, max_match: int = 4) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError(f"NgramDrafter: need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        self.min_match, self.max_match = min_match, max_match
        self._index: weakref.WeakKeyDictionary[Req, tuple[list[int], dict]] = weakref.WeakKeyDictionary()

    def propose(self, reqs: Sequence[Req], ks: Sequence[int]) -> list[list[int]]:
        return [self.propose_one(r, k) for r, k in zip(reqs, ks)]

    def propose_one(self, req: Req, k: int) -> list[int]:
        seq, index = self._extend(req)
        n_seq = len(seq)
        for n in range(min(self.max_match, n_seq - 1), self.min_match - 1, -1):
            at = index.get(tuple(seq[n_seq - n :]))
            if at is not None:
                return seq[at : at + k]
        return []

    def _extend(self, req: Req) -> tuple[list[int], dict]:
        """The request's verified tokens and its index: each n-gram -> the position right after its most
        recent occurrence that is followed by a token."""
        got = self._index.get(req)
        if got is None:
            got = self._index[req] = ([], {})
        seq, index = got
        have = len(seq)
        n_prompt = len(req.prompt_ids)
        if have < n_prompt:
            seq.extend(req.prompt_ids[have:])
        seq.extend(req.output_ids[max(0, len(seq) - n_prompt) :])
        lo, hi = self.min_match, self.max_match
        for i in range(max(have, 1), len(seq)):  # n-grams ending right before position i (seq[i] follows them)
            for n in range(lo, min(hi, i) + 1):
                index[tuple(seq[i - n : i])] = i
        return seq, index


@dataclass
class SpecStats:
    verify_steps: int = 0
    draft_tokens: int = 0  # proposed and verified
    accepted_tokens: int = 0  # drafts the target agreed with
    emitted_tokens: int = 0  # tokens verify steps produced (accepted + one per drafted row)
    declined_tokens: int = 0  # proposed drafts the cost model dropped (spec_cost.py)


@dataclass
class _State:
    k: int  # the next draft length
    misses: int = 0  # verifies in a row that accepted nothing
    pause: int = 0  # steps left without drafting
    backoff: int = PAUSE_STEPS
    hot: bool = True  # the last verify accepted something (or none ran yet)
    kept: float = 0.0  # decayed sums of drafts kept and of drafts tested (kept + the first rejected, if any):
    tested: float = 0.0  # their ratio estimates a draft token's chance to be kept, given those before it were


def _seeded(req: Req) -> bool:
    """A seeded sampled request: the cost model never changes its drafts (they shape its random stream,
    and a seeded request's output must not depend on the machine's timings)."""
    return req.sampling.seed is not None and req.sampling.temperature > 0


def accept_greedy(drafts: Sequence[int], targets: Sequence[int]) -> list[int]:
    """The accepted run: the target's tokens up to and including the first that differs from its draft
    (`targets[i]` is what the target produces after drafts[:i]; len(targets) == len(drafts) + 1)."""
    j = 0
    while j < len(drafts) and drafts[j] == targets[j]:
        j += 1
    return list(targets[: j + 1])


class Speculator:
    def __init__(
        self,
        drafter: Drafter,
        num_draft_tokens: int,
        max_batch_size: int,
        adaptive: bool = True,
        cost_model: bool = False,
    ) -> None:
        self.drafter = drafter
        self.num_draft_tokens = num_draft_tokens
        self.max_batch_size = max_batch_size
        self.adaptive = adaptive
        self.stats = SpecStats()
        self.cost = StepCost() if cost_model else None  # spec_cost.py: do a step's drafts pay?
        self.kept, self.tested = PRIOR_ACCEPTANCE, 1.0  # all rows' (as _State's): a new request's first guess
        self._last_verify = 0  # the last step that verified drafts (the cost model probes after PROBE_EVERY)
        self._explore = False  # unfitted cost model: drafting on every other call
        self._probe_every, self._probed = PROBE_EVERY, False  # doubles while probes change nothing
        self._drain_after = 0  # overlap: no draining for a probe before this step
        self._state: weakref.WeakKeyDictionary[Req, _State] = weakref.WeakKeyDictionary()

    def _get(self, req: Req) -> _State:
        st = self._state.get(req)
        if st is None:
            st = self._state[req] = _State(self.num_draft_tokens)
        return st

    def lengths(self, running: Sequence[Req], max_context_len: int) -> list[int] | None:
        """How many tokens each running request may draft this step (0: none); None when none may."""
        if not running or len(running) > self.max_batch_size:
            return None
        ks = [0] * len(running)
        for i, r in enumerate(running):
            st = self._get(r)
            if st.pause > 0:
                st.pause -= 1
                continue
            k = min(st.k, r.remaining_new_tokens - 1, max_context_len - r.seq_len - 1)
            if k >= 1 and r.sampling.can_draft and not r.pending_ids:
                ks[i] = k
        return ks if any(ks) else None

    def propose(self, running: Sequence[Req], ks: Sequence[int]) -> list[list[int]]:
        """The drafts (at most ks[i] tokens; [] where ks[i] == 0). Their pages are allocated (a draft
        model writes its own K/V for them)."""
        who = [i for i, k in enumerate(ks) if k > 0]
        drafts: list[list[int]] = [[] for _ in running]
        if who:
            got = self.drafter.propose([running[i] for i in who], [ks[i] for i in who])
            for i, d in zip(who, got):
                drafts[i] = [int(t) for t in d[: ks[i]]]
        return drafts

    def observe(self, req: Req, drafted: int, accepted: int) -> None:
        """A verify row of `req` with `drafted` drafts accepted `accepted` of them."""
        s = self.stats
        s.draft_tokens += drafted
        s.accepted_tokens += accepted
        s.emitted_tokens += accepted + 1
        st = self._get(req)
        tested = accepted + (accepted < drafted)  # drafts after the first rejected one were never tested
        st.kept, st.tested = (1 - EWMA) * st.kept + accepted, (1 - EWMA) * st.tested + tested
        self.kept, self.tested = (1 - EWMA) * self.kept + accepted, (1 - EWMA) * self.tested + tested
        if not self.adaptive:
            return
        st.hot = accepted > 0
        if accepted == 0:
            st.misses += 1
            st.k = 1
            if st.misses >= MISSES_TO_PAUSE:
                st.pause, st.backoff, st.misses = st.backoff, min(2 * st.backoff, MAX_PAUSE_STEPS), 0
            return
        st.misses, st.backoff = 0, PAUSE_STEPS
        st.k = min(self.num_draft_tokens, st.k + 1 if accepted == drafted else accepted + 1)

    def observe_step(self, tokens: int, seconds: float, verify: bool) -> None:
        """A decode or verify step of `tokens` query tokens took `seconds` (the runner's measured forward)."""
        if self.cost is not None:
            self.cost.observe(tokens, seconds, verify)

    def _acceptance(self, req: Req) -> float:
        st = self._get(req)
        return st.kept / st.tested if st.tested > 0 else self.kept / self.tested

    def worth(self, running: Sequence[Req], ks: Sequence[int], drafts: list[list[int]], step: int) -> list[list[int]]:
        """The drafts cut to what the cost model expects to pay (spec_cost.choose); unchanged without a
        cost model and when no step has verified drafts for PROBE_EVERY steps (so that acceptance and the
        verify rows' cost keep being measured; twice as long after each probe that changed nothing). Before the model is fitted every other call drafts
        nothing: a plain step beside the verify steps gives the fit the spread of sizes it needs."""
        if self.cost is None or step - self._last_verify >= self._probe_every:
            self._last_verify, self._probed = step, True
            return self._cool(running, ks, drafts)
        fixed = [_seeded(r) for r in running]
        keep = choose(self.cost, [len(d) for d in drafts], [self._acceptance(r) for r in running], fixed)
        if keep is None:
            self._explore = not self._explore
            keep = [len(d) if self._explore or f else 0 for d, f in zip(drafts, fixed)]
        self.stats.declined_tokens += sum(len(d) - k for d, k in zip(drafts, keep))
        if any(keep):
            self._last_verify, self._probe_every = step, PROBE_EVERY
        elif self._probed:  # the probe did not change the verdict: probe half as often (up to 8x)
            self._probe_every = min(8 * PROBE_EVERY, 2 * self._probe_every)
        self._probed = False
        return self._cool(running, ks, [d[:k] for d, k in zip(drafts, keep)])

    def _cool(self, running: Sequence[Req], ks: Sequence[int], drafts: list[list[int]]) -> list[list[int]]:
        """A row asked to draft that ends with none (no n-gram match, or the cost model cut it) is not
        worth draining the overlap for. Decided on the final drafts, which the journal records, so a
        replay (whose drafter only knows those) agrees."""
        for r, k, d in zip(running, ks, drafts):
            if k > 0 and not d:
                self._get(r).hot = False
        return drafts

    def wants_drain(self, running: Sequence[Req], step: int) -> bool:
        """Overlap: is it worth resolving the launched plain decode first, so that this step can draft?"""
        if not running or len(running) > self.max_batch_size:
            return False
        if self.cost is None:
            if step % PROBE_EVERY == 0:
                return True
        elif step - self._last_verify >= self._probe_every and step >= self._drain_after:
            # a probe is due (worth keeps its drafts); once per PROBE_EVERY steps, since rows that cannot
            # draft now would leave it due -- and every step drained, the overlap lost (0.90x on chat, B=8)
            self._drain_after = step + PROBE_EVERY
            return True
        hot = [r.sampling.can_draft and (st := self._get(r)).hot and st.pause == 0 for r in running]
        if not any(hot):
            return False
        if self.cost is None:
            return True
        # drafts of the hot rows' current lengths: if even those would not pay, keep the overlap instead
        ks = [self._get(r).k if h else 0 for r, h in zip(running, hot)]
        keep = choose(self.cost, ks, [self._acceptance(r) for r in running], [_seeded(r) for r in running])
        return keep is None or any(keep)
