"""`ModelDrafter`: speculative decoding's drafts from a second (smaller) model of the same vocabulary.

`EngineConfig(speculative="draft", draft_model=...)` (sched/spec.py has the scheduler's half). The
draft model proposes greedily: for each request it first catches up -- one forward over the tokens
its own cache lacks, ending with the request's last token, whose logits give the first draft --
then runs `k - 1` one-token decode steps. Greedy drafts are deterministic (q one-hot), so the
rejection rule of sampled rows keeps the target's distribution with them too.

Its K/V lives in its own cache tensor (the draft model's geometry) indexed by the *target's* page
ids: the scheduler allocated the request's pages (verified tokens and draft slots alike) before
drafting, so both models' K/V for a token sit at the same slot. What the draft cache holds for a
request is recorded (the tokens fed, the pages they went to, the request's retraction count); the
next catch-up starts at the first position where that differs from the request's verified tokens
and current pages -- so rejected drafts, freed pages, retraction and pages shared through the radix
cache (written again, with the same tokens) only ever cost recomputation. A draft never affects
what is output, only how much of it is accepted. A model drafting for itself accepts everything
under greedy sampling (tests: the tiny model; SmolLM2, slow).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np
import torch

from minisched.base.page_table import build_csr, slots_of
from minisched.model.llama import ForwardMeta, LlamaModel
from minisched.sched.req import Req


class ModelDrafter:
    def __init__(self, model: LlamaModel, num_pages: int, page_size: int, backend: str = "torch") -> None:
        self.model = model
        self.kv_cache = model.new_kv_cache(num_pages, page_size)
        self.page_size = page_size
        self.backend = backend
        self.num_forwards = 0
        # per request: (tokens whose draft K/V is in the cache, the pages they are in, its retraction count)
        self._fed: weakref.WeakKeyDictionary[Req, tuple[list[int], list[int], int]] = weakref.WeakKeyDictionary()

    def _valid(self, req: Req, seq: list[int]) -> int:
        """Leading positions of `seq` whose draft K/V is in the request's current pages."""
        got = self._fed.get(req)
        if got is None or got[2] != req.num_retractions:
            return 0
        toks, pages, _ = got
        n = 0
        for a, b in zip(toks, seq):
            if a != b:
                break
            n += 1
        m = 0
        for a, b in zip(pages, req.page_ids):
            if a != b:
                break
            m += 1
        return min(n, m * self.page_size)

    def _t(self, a, dtype=torch.int32) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=self.model.device, dtype=dtype)

    def _forward(self, reqs: Sequence[Req], ids: list[list[int]], starts: list[int], decode: bool) -> list[int]:
        """Feed ids[i] at positions starts[i].. of reqs[i] (writing the draft K/V); the argmax after each row."""
        ps = self.page_size
        ends = [s + len(x) for s, x in zip(starts, ids)]
        qo = np.zeros(len(reqs) + 1, dtype=np.int32)
        np.cumsum([len(x) for x in ids], out=qo[1:])
        pages = [r.page_ids for r in reqs]
        indptr, indices, last_len = build_csr(pages, ends, ps)
        meta = ForwardMeta(
            positions=self._t(np.concatenate([np.arange(s, e) for s, e in zip(starts, ends)]), torch.int64),
            out_slots=self._t(np.concatenate([slots_of(p, s, e, ps) for p, s, e in zip(pages, starts, ends)])),
            qo_indptr=self._t(qo),
            page_table=(self._t(indptr), self._t(indices), self._t(last_len)),
            logits_indices=self._t(qo[1:] - 1, torch.int64),
            is_decode=decode,
        )
        flat = self._t(np.fromiter((t for x in ids for t in x), dtype=np.int64, count=int(qo[-1])))
        self.num_forwards += 1
        logits = self.model(flat, meta, self.kv_cache, backend=self.backend, check=False)
        return logits.argmax(-1).tolist()

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Req], ks: Sequence[int]) -> list[list[int]]:
        seqs = [list(r.prompt_ids) + list(r.output_ids) for r in reqs]
        starts = [min(self._valid(r, s), len(s) - 1) for r, s in zip(reqs, seqs)]
        first = self._forward(
            reqs, [s[a:] for s, a in zip(seqs, starts)], starts, all(len(s) - a == 1 for s, a in zip(seqs, starts))
        )
        drafts = [[t] for t in first]
        for j in range(1, max(ks)):
            rows = [i for i, k in enumerate(ks) if k > j]
            if not rows:
                break
            got = self._forward(
                [reqs[i] for i in rows], [[drafts[i][-1]] for i in rows], [len(seqs[i]) + j - 1 for i in rows], True
            )
            for i, t in zip(rows, got):
                drafts[i].append(t)
        for r, s, d in zip(reqs, seqs, drafts):
            self._fed[r] = (s + d[:-1], list(r.page_ids), r.num_retractions)
        return drafts
