"""Batched sampling: logits processing, greedy / temperature / min-p / top-k / top-p, and logprobs.

`sample(logits, params, generators, history)` picks one token per row of `logits` [B, V]
(float32), in one vectorized pass per step however the rows' settings differ:

1. processing, for the rows that need it (`SamplingParams.needs_processing`): `min_tokens`
   (the stop tokens get -inf), `logit_bias`, the repetition / frequency / presence penalties
   over each row's history (`RowHistory`), and the grammar mask (`masks`, a bool [B, V]
   tensor: False = not allowed; from structured.py);
2. rows with temperature 0 take the argmax of the processed logits;
3. the others: divide by the temperature, drop tokens under `min_p` x the top probability,
   keep the top-k and the smallest set whose probability reaches top-p, and draw by inverse
   CDF with one uniform number from the row's own `torch.Generator` -- so a seeded request
   samples the same tokens whatever else shares its batch (up to floating-point noise).

`verify_drafts` is speculative decoding's acceptance (greedy, and the rejection rule that keeps
sampled outputs distributed as the target's); `target_probs` the distribution a row samples from.

`logprobs_of(logits, rows, tokens, k)` gives the log-probabilities the API returns: the
log-softmax of the *raw* logits in float32 (before processing and temperature, vLLM's default
"raw_logprobs"), the chosen token's and the top k.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from minisched.sched.sampling_params import MAX_LOGPROBS, SamplingParams
from minisched.sched.spec import accept_greedy


@dataclass
class RowHistory:
    """What a row's penalties and `min_tokens` read: its prompt and the output tokens before the one
    being sampled (overlap: placeholders, resolved by the runner before sampling)."""

    prompt: Sequence[int]
    output: Sequence[int]


def make_generator(seed: Optional[int]) -> torch.Generator:
    """A CPU generator: seeded when the request has a seed, else from fresh entropy."""
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[Optional[torch.Generator]],
    history: Optional[Sequence[Optional[RowHistory]]] = None,
    masks: Optional[torch.Tensor] = None,
) -> list[int]:
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(f"logits must be [B, V] with B == len(params) ({len(params)}), got {tuple(logits.shape)}")
    if any(p.needs_processing for p in params) or masks is not None:
        logits = process_logits(logits, params, history, masks)
    out = torch.argmax(logits, dim=-1)
    rows = [i for i, p in enumerate(params) if p.temperature > 0]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        drawn = _sample_rows(logits[idx].float(), [params[i] for i in rows], [generators[i] for i in rows])
        out = out.clone()
        out[idx] = drawn
    return out.tolist()


def process_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    history: Optional[Sequence[Optional[RowHistory]]],
    masks: Optional[torch.Tensor],
) -> torch.Tensor:
    """A processed float32 copy of `logits` (see the module docstring, step 1)."""
    x = logits.float().clone()
    dev, vocab = x.device, x.shape[-1]
    neg_inf = float("-inf")
    # min_tokens: no stop token before the minimum
    rows, cols = [], []
    for i, p in enumerate(params):
        if p.min_tokens and len(_hist(history, i).output) < p.min_tokens:
            for t in p.stop_token_ids:
                if t < vocab:
                    rows.append(i)
                    cols.append(t)
    if rows:
        x[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] = neg_inf
    # logit_bias
    rows, cols, vals = [], [], []
    for i, p in enumerate(params):
        for t, b in p.logit_bias:
            if t < vocab:
                rows.append(i)
                cols.append(t)
                vals.append(b)
    if rows:
        x.index_put_(
            (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
            torch.tensor(vals, dtype=torch.float32, device=dev),
            accumulate=True,
        )
    # penalties
    pen = [i for i, p in enumerate(params) if p.has_penalties]
    if pen:
        idx = torch.tensor(pen, device=dev)
        sub = x[idx]
        out_counts = _counts([_hist(history, i).output for i in pen], vocab, dev)
        freq = torch.tensor([params[i].frequency_penalty for i in pen], dtype=torch.float32, device=dev)
        pres = torch.tensor([params[i].presence_penalty for i in pen], dtype=torch.float32, device=dev)
        sub = sub - freq[:, None] * out_counts - pres[:, None] * (out_counts > 0).float()
        rep = torch.tensor([params[i].repetition_penalty for i in pen], dtype=torch.float32, device=dev)
        if (rep != 1).any():
            seen = (out_counts > 0) | (_counts([_hist(history, i).prompt for i in pen], vocab, dev) > 0)
            scaled = torch.where(sub > 0, sub / rep[:, None], sub * rep[:, None])
            sub = torch.where(seen, scaled, sub)
        x[idx] = sub
    if masks is not None:
        x = x.masked_fill(~masks, neg_inf)
    return x


def _hist(history, i: int) -> RowHistory:
    h = history[i] if history is not None else None
    if h is None:
        raise ValueError("sampling with penalties or min_tokens needs the row's token history")
    return h


def _counts(seqs: Sequence[Sequence[int]], vocab: int, dev) -> torch.Tensor:
    """[R, V] float32: how often each token id occurs in each row's sequence (one scatter_add)."""
    width = max((len(s) for s in seqs), default=0)
    counts = torch.zeros(len(seqs), vocab + 1, dtype=torch.float32, device=dev)
    if width:
        ids = torch.full((len(seqs), width), vocab, dtype=torch.int64)
        for r, s in enumerate(seqs):
            if len(s):
                ids[r, : len(s)] = torch.as_tensor(list(s), dtype=torch.int64).clamp_(0, vocab)
        counts.scatter_add_(1, ids.to(dev), torch.ones(ids.shape, dtype=torch.float32, device=dev))
    return counts[:, :vocab]


def _sample_rows(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[Optional[torch.Generator]]
) -> torch.Tensor:
    dev, vocab = logits.device, logits.shape[-1]
    probs, order = _sorted_probs(logits, params)
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.stack([torch.rand((), generator=g) if g is not None else torch.rand(()) for g in generators])
    u = u.to(dev) * cdf[:, -1]
    pick = torch.searchsorted(cdf, u[:, None], right=True).clamp(max=vocab - 1)
    # never land on a zeroed tail entry (u == total mass up to rounding)
    last_kept = (probs > 0).sum(-1, keepdim=True) - 1
    pick = torch.minimum(pick, last_kept)
    return order.gather(1, pick).squeeze(1)


def target_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from ([R, V], vocabulary order, sums to 1): temperature, min_p,
    top-k and top-p applied to `logits` (already processed) as `sample` does."""
    probs, order = _sorted_probs(logits.float(), params)
    out = torch.zeros_like(probs).scatter_(1, order, probs)
    return out / out.sum(-1, keepdim=True)


def _sorted_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """(unnormalized kept probabilities in descending order, the token ids of that order)."""
    dev, vocab = logits.device, logits.shape[-1]
    temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
    logits = logits / temp[:, None]
    if any(p.min_p > 0 for p in params):  # drop tokens below min_p x the most likely one's probability
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), float("-inf"))
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    # top-k: drop everything after rank k (k = -1 keeps all)
    k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev).clamp(max=vocab)
    ranks = torch.arange(vocab, device=dev)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # top-p: keep a token if the mass strictly before it is < top_p (the first token always stays)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
    before = torch.cumsum(probs, dim=-1) - probs
    return probs.masked_fill(before >= top_p[:, None], 0.0), order


def _uniform(g: Optional[torch.Generator]) -> float:
    return float(torch.rand((), generator=g) if g is not None else torch.rand(()))


def _draw(probs: torch.Tensor, g: Optional[torch.Generator]) -> int:
    """One token from a (possibly unnormalized) probability vector [V], by inverse CDF."""
    cdf = torch.cumsum(probs.double(), dim=0)
    pick = int(torch.searchsorted(cdf, torch.tensor([_uniform(g) * float(cdf[-1])], dtype=cdf.dtype), right=True))
    nz = torch.nonzero(probs > 0)
    return min(pick, int(nz[-1])) if len(nz) else pick


def verify_drafts(
    logits: Sequence[torch.Tensor],
    drafts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    generators: Sequence[Optional[torch.Generator]],
    draft_probs: Optional[Sequence[Optional[torch.Tensor]]] = None,
) -> list[list[int]]:
    """Speculative decoding's acceptance, per row: `logits[i]` [k_i + 1, V] are the target's at the
    positions of row i's last token and its k_i drafts; returns the accepted run (the accepted drafts,
    then one token of the target's: the correction or the bonus).

    Greedy rows (temperature 0): the drafts that equal the argmax, then the argmax. Sampled rows: the
    standard rejection rule (Leviathan et al.; FlashInfer's `chain_speculative_sampling`), so the
    output is distributed as the target's: draft d at position j is accepted with probability
    min(1, p_j(d) / q_j(d)); at the first rejection the token is drawn from max(0, p_j - q_j)
    (normalized) and the run ends; if all are accepted a bonus is drawn from p_k. `draft_probs[i]`
    [k_i, V] is the drafter's q (None: the draft was deterministic, q one-hot -- n-gram drafts).
    p is `target_probs` (temperature, min_p, top-k, top-p); rows must not need logit processing
    (`SamplingParams.can_draft`)."""
    runs: list[list[int]] = [[] for _ in drafts]
    greedy = [i for i, p in enumerate(params) if p.temperature <= 0]
    if greedy:
        best = torch.cat([logits[i] for i in greedy]).argmax(-1).tolist()
        at = 0
        for i in greedy:
            n = len(drafts[i]) + 1
            runs[i] = accept_greedy(drafts[i], best[at : at + n])
            at += n
    for i, sp in enumerate(params):
        if sp.temperature <= 0:
            continue
        d, g = list(drafts[i]), generators[i]
        p = target_probs(logits[i], [sp] * logits[i].shape[0])
        q = None if draft_probs is None else draft_probs[i]
        run = []
        for j, tok in enumerate(d):
            pd = float(p[j, tok])
            qd = 1.0 if q is None else float(q[j, tok])
            if _uniform(g) * qd < pd:  # accept with probability min(1, p/q)
                run.append(tok)
                continue
            resid = p[j].clone()
            if q is None:
                resid[tok] = 0.0
            else:
                resid = (resid - q[j].to(resid)).clamp_(min=0.0)
            run.append(_draw(resid if float(resid.sum()) > 0 else p[j], g))
            break
        else:
            run.append(_draw(p[len(d)], g))
        runs[i] = run
    return runs


def logprobs_of(
    logits: torch.Tensor, tokens: Sequence[int], k: int
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """For each row of raw `logits` [R, V]: log p(tokens[r]) and the k most likely (id, log p), from the
    float32 log-softmax (ties: lower ids first, as torch.topk on CPU)."""
    if not 0 <= k <= MAX_LOGPROBS:
        raise ValueError(f"k must be in [0, {MAX_LOGPROBS}], got {k}")
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.as_tensor(list(tokens), dtype=torch.int64, device=lp.device)[:, None])[:, 0]
    top: list[list[tuple[int, float]]] = [[] for _ in tokens]
    if k:
        vals, ids = torch.topk(lp, k, dim=-1)
        top = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    return chosen.tolist(), top
