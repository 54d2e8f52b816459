"""Which rows' logits a step computes, and the log-probabilities read from them.

A step needs the logits of each sampled row's last token. A prefill row whose request asks for
prompt logprobs (`SamplingParams.prompt_logprobs`) also needs the logits of its chunk's
positions q that predict a prompt token still owed (`Req.logits_from` <= q, q + 1 < prompt
length): the log-probability of prompt token q + 1 is read from the logits at q. A chunk that
does not finish its prompt computes its last row anyway; that row predicts the next chunk's
first token. Only rows from the request's start are computed, and the radix-cache match stops
before them (prefill_adder.py), so cached K/V is reused but no logit is ever skipped.

`plan_logits(batch)` lists the rows (`rows`, flat token indices for `ForwardMeta.logits_indices`),
where each sampled row's logits land (`sample_at`), and the prompt spans. `read_logprobs`
turns the computed logits into `TokenLogprob`s (sampling.logprobs_of: raw log-softmax).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from minisched.model.sampling import logprobs_of
from minisched.sched.batch import Batch
from minisched.sched.step_output import StepOutput, TokenLogprob


@dataclass
class PromptSpan:
    row: int  # batch row
    start: int  # index of its first logits row in the computed logits
    targets: list[int]  # the prompt tokens those rows predict
    k: int  # top alternatives asked for


@dataclass
class LogitsPlan:
    rows: np.ndarray  # int64 flat token rows, the model's logits_indices
    sample_at: Optional[list[int]]  # where each sampled row's logits are (None: the first ones, in order)
    spans: list[PromptSpan] = field(default_factory=list)


def plan_logits(batch: Batch) -> LogitsPlan:
    last = batch.logits_indices()
    sampled = [b for b, s in enumerate(batch.sampled) if s]
    want = [(b, r.logits_from) for b, r in enumerate(batch.reqs) if r.logits_from is not None]
    if not want:
        return LogitsPlan(last[sampled].astype(np.int64), None)
    qo = batch.qo_indptr()
    rows: list[int] = []
    sample_at: dict[int, int] = {}
    spans = []
    wanted = dict(want)
    for b, (req, p, e) in enumerate(zip(batch.reqs, batch.prefix_lens, batch.extend_lens)):
        lo, k = wanted.get(b), req.sampling.prompt_logprobs  # (logits_from is set only when k is)
        if lo is not None and k is not None:
            first, end = max(p, lo), min(p + e, req.prompt_len - 1)  # q in [first, end): predicts q + 1
            if end > first:
                spans.append(PromptSpan(b, len(rows), req.prompt_ids[first + 1 : end + 1], k))
                rows.extend(range(int(qo[b]) + first - p, int(qo[b]) + end - p))
        if batch.sampled[b]:
            flat = int(last[b])
            if rows and rows[-1] == flat:  # (cannot happen: the sampled row predicts past the prompt)
                sample_at[b] = len(rows) - 1
            else:
                sample_at[b] = len(rows)
                rows.append(flat)
    return LogitsPlan(np.asarray(rows, dtype=np.int64), [sample_at[b] for b in sampled], spans)


def read_logprobs(
    logits: torch.Tensor,
    plan: LogitsPlan,
    sample_logits: torch.Tensor,
    sampled_rows: list[int],
    picked: list[int],
    ks: list[Optional[int]],
    batch_size: int,
    tokens: list[int],
) -> StepOutput:
    """The step's StepOutput: tokens, and the logprobs the rows asked for (`ks`: per sampled row)."""
    out = StepOutput(tokens)
    asked = {i: k for i, k in enumerate(ks) if k is not None}
    if asked:
        idx = torch.tensor(list(asked), device=sample_logits.device)
        chosen, top = logprobs_of(sample_logits[idx], [picked[i] for i in asked], max(asked.values()))
        out.logprobs = [None] * batch_size
        for j, (i, k) in enumerate(asked.items()):
            out.logprobs[sampled_rows[i]] = TokenLogprob(picked[i], chosen[j], tuple(top[j][:k]))
    if plan.spans:
        out.prompt_logprobs = [None] * batch_size
        for span in plan.spans:
            n = len(span.targets)
            chosen, top = logprobs_of(logits[span.start : span.start + n], span.targets, span.k)
            out.prompt_logprobs[span.row] = [
                TokenLogprob(t, c, tuple(tp)) for t, c, tp in zip(span.targets, chosen, top)
            ]
    return out
