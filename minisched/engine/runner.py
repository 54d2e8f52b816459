"""`ModelRunner`: turns a scheduler `Batch` into model inputs, runs the model, samples one token per request.

The runner owns the KV pool tensor `kv_cache[L, 2, num_pages, page_size, Hkv, D]` (the scheduler
owns the page bookkeeping) and the per-request random generators. It satisfies the scheduler's
runner protocol: `forward(batch) -> StepOutput`, one token per request in batch order (rows that
are unfinished prompt chunks get 0: the scheduler ignores them, and they draw no random number)
and the log-probabilities the rows asked for. Every sampled row's token is drawn by `_sample_rows`,
a plain step's and a VERIFY step's rows without drafts alike.

Cascade decode (`cascade=True`): in a decode batch, requests whose page lists start with the
same page (a shared radix-cache prefix, e.g. a common system prompt) form a group; the group's
common leading full pages -- all before each member's new token -- are its shared prefix,
attended once per group by `ops.cascade_decode_attention`; every other request runs plain
paged decode. Greedy output is identical either way (test_engine checks it).

A VERIFY batch (speculative decoding, sched/spec.py) runs as a prefill extend (each row's last
token and its drafts, causal) with logits at every position; `_verify` returns each row's accepted
run in `StepOutput.more_tokens`. The next step is only built once it is resolved (no placeholders).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from minisched import ops
from minisched.base.page_table import build_csr
from minisched.engine.cuda_graph import CudaGraphRunner
from minisched.engine.kv_tier import HostKVMover
from minisched.engine.logits_plan import LogitsPlan, plan_logits, read_logprobs
from minisched.engine.structured import Matchers
from minisched.engine.threads import ThreadTuner
from minisched.model.llama import CascadeMeta, ForwardMeta, LlamaModel, PageTable
from minisched.model.sampling import RowHistory, logprobs_of, make_generator, sample, verify_drafts
from minisched.sched.batch import Batch, ForwardMode
from minisched.sched.req import Req
from minisched.sched.sampling_params import SamplingParams
from minisched.sched.step_output import StepOutput, TokenLogprob

if TYPE_CHECKING:
    from minisched.parallel.launch import TPSession


def cascade_groups(page_lists: list[list[int]], kv_lens: list[int], page_size: int):
    """Group decode requests by shared leading full pages.

    Returns (groups, plain): groups is a list of (member batch indices, number of shared pages),
    each with >= 2 members and >= 1 shared page that lies wholly before every member's last token;
    plain lists the indices that run plain decode."""
    by_first: dict[int, list[int]] = {}
    plain = []
    for b, (pages, n) in enumerate(zip(page_lists, kv_lens)):
        if (n - 1) // page_size >= 1:
            by_first.setdefault(pages[0], []).append(b)
        else:
            plain.append(b)
    groups = []
    for members in by_first.values():
        if len(members) < 2:
            plain.extend(members)
            continue
        limit = min((kv_lens[b] - 1) // page_size for b in members)
        first = page_lists[members[0]]
        shared = 0
        while shared < limit and all(page_lists[b][shared] == first[shared] for b in members):
            shared += 1
        groups.append((members, shared))  # shared >= 1: they all start with the same page
    return groups, sorted(plain)


FUTURE_RING = 1 << 16  # placeholder-token slots (overlap): far more than the rows of the two batches in flight
NO_SPANS = LogitsPlan(np.zeros(0, dtype=np.int64), None)  # a VERIFY step reads no prompt logprobs


@dataclass(kw_only=True)
class ForwardJob:
    """One step's inputs, built by `prepare` on the scheduling thread. `execute` reads nothing else,
    so it may run on another thread while the scheduler changes its requests (overlap scheduling)."""

    input_ids: torch.Tensor  # int32 [N]; negative: a placeholder for a token an earlier job samples
    meta: ForwardMeta
    num_tokens: int
    batch_size: int
    rows: list[int]  # rows that sample a token
    params: list[SamplingParams]
    generators: list[Optional[torch.Generator]]
    has_futures: bool  # input_ids may hold placeholders
    future_slots: Optional[torch.Tensor]  # int64: where each sampled row's token goes in the future map
    plan: LogitsPlan  # the rows whose logits are computed (sampling, prompt logprobs)
    reqs: list[Req]  # the sampled rows' requests (structured outputs: their grammar matchers)
    loads: list  # host tier: (host copy, device pages) to copy in before the forward
    copies: list  # n > 1: (source page, page) copy-on-write of a forked prompt's last page, before the forward
    history: Optional[list[Optional[RowHistory]]]  # per sampled row, for penalties and min_tokens
    drafts: Optional[list[list[int]]] = None  # VERIFY: per row, its draft tokens (logits at every position)
    qo: Optional[list[int]] = None  # VERIFY: each row's first token in the flattened tokens (and the end)


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_cache: torch.Tensor,
        page_size: int,
        *,
        backend: str = "torch",  # one of ops.BACKENDS
        cascade: bool = False,
        check: bool = False,
        thread_tuner: Optional[ThreadTuner] = None,
        cuda_graphs: Optional[CudaGraphRunner] = None,
        kv_mover: Optional[HostKVMover] = None,
        tp_session: Optional[TPSession] = None,
    ):
        self.model = model
        self.cuda_graphs = cuda_graphs  # decode steps replay a captured graph (engine/cuda_graph.py)
        self.thread_tuner = thread_tuner
        self.kv_cache = kv_cache
        self.page_size = page_size
        self.backend: ops.Backend = ops.as_backend(backend)
        self.cascade = cascade
        self.check = check
        self.device = model.device
        self._generators: weakref.WeakKeyDictionary[Req, torch.Generator] = weakref.WeakKeyDictionary()
        self.num_forwards = 0
        self.forward_time = 0.0  # seconds in `execute` (forward and sampling), summed over the steps
        self.num_cascade_steps = 0
        self._futures: Optional[torch.Tensor] = None  # overlap: tokens sampled for placeholder ids
        self.matchers = Matchers(model.cfg.vocab_size)  # structured outputs (engine/structured.py)
        self.kv_mover = kv_mover  # the host KV tier's (engine/kv_tier.py): a batch's loads run first
        # tensor parallelism: the forward proper runs on every rank (the session's workers get a pool like this one)
        self.tp_session = tp_session
        if tp_session is not None:
            tp_session.attach(kv_cache, page_size, backend, check)

    def health(self) -> Optional[str]:
        """None while this runner can run steps, else why not (a tensor-parallel rank died or hung)."""
        return None if self.tp_session is None else self.tp_session.health()

    # -- inputs --------------------------------------------------------------------------------------
    def _t(self, a: np.ndarray, dtype=torch.int32) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=self.device, dtype=dtype)

    def _table(self, csr: tuple[np.ndarray, np.ndarray, np.ndarray]) -> PageTable:
        indptr, indices, last = csr
        return self._t(indptr), self._t(indices), self._t(last)

    def build_meta(self, batch: Batch, plan: Optional[LogitsPlan] = None) -> tuple[torch.Tensor, ForwardMeta]:
        plan = plan or plan_logits(batch)
        table = batch.page_table()
        meta = ForwardMeta(
            positions=self._t(batch.positions(), torch.int64),
            out_slots=self._t(batch.out_slots()),
            qo_indptr=self._t(batch.qo_indptr()),
            page_table=self._table(table),
            logits_indices=self._t(plan.rows, torch.int64),
            is_decode=batch.mode is ForwardMode.DECODE,
        )
        if meta.is_decode and self.cascade:
            meta.cascade = self._cascade_meta(batch)
        return self._t(batch.input_ids()), meta

    def _cascade_meta(self, batch: Batch) -> Optional[CascadeMeta]:
        ps = self.page_size
        kv_lens = [p + e for p, e in zip(batch.prefix_lens, batch.extend_lens)]
        pages = [r.page_ids for r in batch.reqs]
        groups, plain = cascade_groups(pages, kv_lens, ps)
        if not groups:
            return None
        rows, group_indptr, pre_pages, pre_lens, suf_pages, suf_lens = [], [0], [], [], [], []
        for members, shared in groups:
            rows.extend(members)
            group_indptr.append(len(rows))
            pre_pages.append(pages[members[0]][:shared])
            pre_lens.append(shared * ps)
            for b in members:
                suf_pages.append(pages[b][shared:])
                suf_lens.append(kv_lens[b] - shared * ps)
        self.num_cascade_steps += 1
        plain_table = (
            build_csr([pages[b] for b in plain], [kv_lens[b] for b in plain], ps)
            if plain
            else (np.zeros(1, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32))
        )
        return CascadeMeta(
            rows=self._t(np.asarray(rows), torch.int64),
            group_indptr=self._t(np.asarray(group_indptr)),
            prefix_table=self._table(build_csr(pre_pages, pre_lens, ps)),
            suffix_table=self._table(build_csr(suf_pages, suf_lens, ps)),
            plain_rows=self._t(np.asarray(plain, dtype=np.int64), torch.int64),
            plain_table=self._table(plain_table),
        )

    # -- the step ------------------------------------------------------------------------------------
    def generator_for(self, req: Req) -> Optional[torch.Generator]:
        if req.sampling.temperature <= 0:
            return None
        g = self._generators.get(req)
        if g is None:
            g = self._generators[req] = make_generator(req.sampling.seed)
        return g

    def run_model(self, input_ids: torch.Tensor, meta: ForwardMeta) -> torch.Tensor:
        """The forward proper: logits of the rows to sample (with tensor parallelism the session first sends
        the step to the other ranks)."""
        if self.tp_session is not None:
            return self.tp_session.run_step(self.kv_cache, input_ids, meta, backend=self.backend, check=self.check)
        return self.model(input_ids, meta, self.kv_cache, backend=self.backend, check=self.check)

    def forward(self, batch: Batch) -> StepOutput:
        return self.execute(self.prepare(batch))

    def prepare(self, batch: Batch) -> ForwardJob:
        """Everything the step needs from the batch and its requests (overlap: after `Scheduler.launch`,
        which gave the sampled rows their placeholder ids in `batch.future_ids`)."""
        verify = batch.mode is ForwardMode.VERIFY
        plan = LogitsPlan(np.arange(batch.num_tokens, dtype=np.int64), None) if verify else plan_logits(batch)
        input_ids, meta = self.build_meta(batch, plan)
        rows = [b for b, s in enumerate(batch.sampled) if s]
        reqs = [batch.reqs[b] for b in rows]
        slots = None
        if batch.future_ids:
            slots = self._t(np.asarray([(-batch.future_ids[b] - 1) % FUTURE_RING for b in rows], np.int64), torch.int64)
        history: Optional[list[Optional[RowHistory]]] = None
        if any(r.sampling.needs_processing for r in reqs):  # penalties and min_tokens read the tokens so far
            history = []
            for b, r in zip(rows, reqs):
                if r.sampling.needs_processing:
                    fill = r.fill_ids[: batch.prefix_lens[b] + batch.extend_lens[b]]  # before the token sampled now
                    history.append(RowHistory(fill[: r.prompt_len], fill[r.prompt_len :]))
                else:
                    history.append(None)
        return ForwardJob(
            input_ids=input_ids,
            meta=meta,
            num_tokens=batch.num_tokens,
            batch_size=batch.batch_size,
            rows=rows,
            params=[r.sampling for r in reqs],
            generators=[self.generator_for(r) for r in reqs],
            has_futures=any(r.pending_ids for r in batch.reqs),
            future_slots=slots,
            plan=plan,
            reqs=reqs,
            loads=batch.loads,
            copies=batch.copies,
            history=history,
            drafts=list(batch.drafts) if verify else None,
            qo=batch.qo_indptr().tolist() if verify else None,
        )

    def _future_map(self) -> torch.Tensor:
        if self._futures is None:
            self._futures = torch.zeros(FUTURE_RING, dtype=torch.int32, device=self.device)
        return self._futures

    def execute(self, job: ForwardJob) -> StepOutput:
        """Forward and sampling; one token per row (0 for rows that sample none). Placeholders in the
        inputs are swapped for the tokens earlier jobs sampled (they ran before this one, in order)."""
        self.num_forwards += 1
        tuner = self.thread_tuner
        if tuner is not None:
            tuner.before_step(job.num_tokens)
        t0 = time.perf_counter()
        logits = self._run_forward(job)
        out = self._verify(job, logits) if job.drafts is not None else self._sample(job, logits)
        took = time.perf_counter() - t0
        self.forward_time += took
        if tuner is not None:
            tuner.after_step(job.num_tokens, took)
        out.seconds = took  # the speculator's step-cost model (sched/spec_cost.py) learns from it
        return out

    def _run_forward(self, job: ForwardJob) -> torch.Tensor:
        """The job's host-tier loads and page copies, then the forward: the logits of its plan's rows."""
        if job.loads:  # host-tier hits back into their device pages, before anything reads them
            mover = self.kv_mover
            if mover is None:
                raise RuntimeError("the batch loads host-tier KV pages but the runner has no host KV mover")
            for handle, pages in job.loads:
                mover.to_device(handle, pages)
        if job.copies:  # all layers, K and V, one launch
            src, dst = (torch.tensor(x, dtype=torch.int32, device=self.device) for x in zip(*job.copies))
            ops.copy_kv_pages(self.kv_cache, src, dst, backend=self.backend, check=False)
        input_ids = job.input_ids
        if job.has_futures:
            fut = self._future_map()
            input_ids = torch.where(input_ids < 0, fut[(-input_ids.long() - 1) % FUTURE_RING], input_ids)
        graphs = self.cuda_graphs
        logits = graphs.run(input_ids, job.meta) if graphs is not None else None
        return self.run_model(input_ids, job.meta) if logits is None else logits

    def _sample_rows(self, job: ForwardJob, logits: torch.Tensor, which: list[int], tokens: list[int]) -> list[int]:
        """The one way a row's token is drawn: sampled rows `which` (indices into the job's sampled rows)
        from `logits` (one row each, in that order): their history (placeholders resolved), grammar
        masks, sampling, the grammars' acceptance; the tokens go to `tokens` at their batch rows."""
        params = [job.params[i] for i in which]
        history = None
        if job.history:
            history = [job.history[i] for i in which]
            history = self._resolve_history(history) if job.has_futures else history
        constrained = any(p.grammar is not None for p in params)
        reqs = [job.reqs[i] for i in which] if constrained else []
        masks = self.matchers.masks(reqs) if constrained else None
        picked = sample(logits, params, [job.generators[i] for i in which], history, masks)
        if constrained:
            self.matchers.accept(reqs, picked)
        for i, t in zip(which, picked):
            tokens[job.rows[i]] = t
        return picked

    def _sample(self, job: ForwardJob, logits: torch.Tensor) -> StepOutput:
        """A step without drafts: every sampled row's token at its plan row, and the logprobs asked for."""
        plan, tokens, picked, sample_logits = job.plan, [0] * job.batch_size, [], logits
        which = list(range(len(job.rows)))
        if which:
            sample_logits = logits if plan.sample_at is None else logits[torch.tensor(plan.sample_at)]
            picked = self._sample_rows(job, sample_logits, which, tokens)
            if job.future_slots is not None:
                self._future_map()[job.future_slots] = torch.tensor(picked, dtype=torch.int32, device=self.device)
        return self._with_logprobs(job, logits, plan, sample_logits, which, picked, tokens)

    def _with_logprobs(
        self,
        job: ForwardJob,
        logits: torch.Tensor,
        plan: LogitsPlan,
        sample_logits: torch.Tensor,
        which: list[int],
        picked: list[int],
        tokens: list[int],
    ) -> StepOutput:
        """The step's output: the tokens, and the logprobs rows `which` (sampled from `sample_logits`)
        and the plan's prompt spans asked for."""
        ks = [job.params[i].logprobs for i in which]
        if not plan.spans and all(k is None for k in ks):
            return StepOutput(tokens)
        rows = [job.rows[i] for i in which]
        return read_logprobs(logits, plan, sample_logits, rows, picked, ks, job.batch_size, tokens)

    def _verify(self, job: ForwardJob, logits: torch.Tensor) -> StepOutput:
        """A VERIFY step (sched/spec.py; every row is sampled): rows without drafts sample their token as
        a decode step does; rows with drafts get their accepted run (`verify_drafts`: greedy, or the
        rejection rule)."""
        qo, drafts, n = job.qo, job.drafts, job.batch_size
        if qo is None or drafts is None:
            raise ValueError("a VERIFY job needs its rows' drafts and token offsets (qo)")
        tokens: list[int] = [0] * n
        more: list[list[int]] = [[] for _ in range(n)]
        plain = [i for i in range(n) if not drafts[i]]
        out = StepOutput(tokens)
        if plain:
            sub = logits[torch.tensor([qo[i] for i in plain], device=logits.device)]
            picked = self._sample_rows(job, sub, plain, tokens)
            out = self._with_logprobs(job, logits, NO_SPANS, sub, plain, picked, tokens)
        out.more_tokens = more
        drafted = [i for i in range(n) if drafts[i]]
        if drafted:
            runs = verify_drafts(
                [logits[qo[i] : qo[i + 1]] for i in drafted],
                [drafts[i] for i in drafted],
                [job.params[i] for i in drafted],
                [job.generators[i] for i in drafted],
            )
            for i, run in zip(drafted, runs):
                tokens[i], more[i] = run[0], run[1:]
                k = job.params[i].logprobs
                if k is not None:  # the target's logits at the run's positions: each accepted token's logprob
                    chosen, top = logprobs_of(logits[qo[i] : qo[i] + len(run)], run, k)
                    got = [TokenLogprob(t, c, tuple(tp[:k])) for t, c, tp in zip(run, chosen, top)]
                    if out.logprobs is None:
                        out.logprobs = [None] * n
                    if out.more_logprobs is None:
                        out.more_logprobs = [None] * n
                    out.logprobs[i], out.more_logprobs[i] = got[0], got[1:]
        return out

    def _resolve_history(self, history: list[Optional[RowHistory]]) -> list[Optional[RowHistory]]:
        """Overlap: the placeholders in a history are tokens earlier jobs sampled (in the future map)."""
        neg = sorted({t for h in history if h is not None for t in h.output if t < 0})
        if not neg:
            return history
        got = self._future_map()[torch.tensor([(-t - 1) % FUTURE_RING for t in neg])].tolist()
        real = dict(zip(neg, got))
        return [None if h is None else RowHistory(h.prompt, [real.get(t, t) for t in h.output]) for h in history]
