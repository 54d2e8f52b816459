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
    rows = [i for i, p in enumerate(params) if p.temperature > 0]
    if not rows:
        return torch.argmax(logits, dim=-1).tolist()
    if len(rows) == len(params):  # all sampled: no copy of the logits, no argmax
        return _sample_rows(logits.float(), params, generators).tolist()
    out = torch.argmax(logits, dim=-1)
    idx = torch.tensor(rows, device=logits.device)
    out[idx] = _sample_rows(logits[idx].float(), [params[i] for i in rows], [generators[i] for i in rows])
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
    """One token per row by inverse CDF over the row's kept probabilities (`_kept_probs`), with one
    uniform number from the row's own generator."""
    u = torch.stack([torch.rand((), generator=g) if g is not None else torch.rand(()) for g in generators])
    out = torch.empty(len(params), dtype=torch.int64, device=logits.device)
    for rows, probs, ids in _kept_probs(logits, params):
        cdf = torch.cumsum(probs, dim=-1)
        x = u[rows].to(cdf.device) * cdf[:, -1]
        # searchsorted stops on an entry whose probability is > 0 (the cdf rises there), except past the
        # end (x == the total mass up to rounding): then the last kept entry
        pick = torch.searchsorted(cdf, x[:, None], right=True).clamp_(max=probs.shape[-1] - 1)
        past = (probs.gather(1, pick) == 0)[:, 0].nonzero()[:, 0]
        if len(past):
            cols = torch.arange(probs.shape[-1], device=probs.device)
            pick[past] = torch.where(probs[past] > 0, cols, 0).amax(-1, keepdim=True)
        out[rows] = pick.squeeze(1) if ids is None else ids.gather(1, pick).squeeze(1)
    return out


def target_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from ([R, V], vocabulary order, sums to 1): temperature, min_p,
    top-k and top-p applied to `logits` (already processed) as `sample` does."""
    logits = logits.float()
    out = torch.zeros_like(logits)
    for rows, probs, ids in _kept_probs(logits, params):
        out[rows] = probs if ids is None else torch.zeros_like(out[rows]).scatter_(1, ids, probs)
    return out / out.sum(-1, keepdim=True)


# Rows with top-p or min-p (and no top-k) look at this many most likely tokens, then at the second count
# for the rows whose kept set may run past the first: exact without sorting the vocabulary when the kept
# set ends inside (torch.topk of 256 / 4,096 of 49,152 logits costs ~1/10 / ~1/4 of a full sort); a row
# whose kept set runs past both gets the full sort.
CANDIDATES = (256, 4096)


def _truncates(p: SamplingParams) -> bool:
    return p.top_k > 0 or p.top_p < 1 or p.min_p > 0


def _kept_probs(
    logits: torch.Tensor, params: Sequence[SamplingParams]
) -> list[tuple[list[int], torch.Tensor, Optional[torch.Tensor]]]:
    """The rows' kept probabilities (unnormalized, 0 where dropped), in groups: (row indices, probs [r, C],
    token ids [r, C] or None for vocabulary order). Each row's result depends only on its own logits and
    settings, never on the rows beside it (a seeded request draws the same token in any batch).

    Why groups: a full sort of the vocabulary (49,152 tokens for SmolLM2) costs ~4 ms a row on a CPU --
    at 64 rows more than the forward -- and most requests need none. Temperature alone needs no order
    (the CDF is taken in vocabulary order); top-k takes the k largest (torch.topk); top-p and min-p take
    the CANDIDATES largest and check that the kept set ends inside them (otherwise more, then the full sort)."""
    dev, vocab = logits.device, logits.shape[-1]
    temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
    logits = logits / temp[:, None]
    plain = [i for i, p in enumerate(params) if not _truncates(p)]
    cut = [i for i, p in enumerate(params) if _truncates(p)]
    groups: list[tuple[list[int], torch.Tensor, Optional[torch.Tensor]]] = []
    if plain:
        groups.append((plain, torch.softmax(logits if not cut else logits[plain], dim=-1), None))
    for candidates in CANDIDATES:
        if not cut:
            break
        sub = [params[i] for i in cut]
        probs, ids, exact = _top_candidates(logits[cut], sub, candidates)
        done = [j for j, ok in enumerate(exact) if ok]
        if done:
            groups.append(([cut[j] for j in done], probs[done], ids[done]))
        cut = [cut[j] for j, ok in enumerate(exact) if not ok]
    if cut:
        full, order = _sorted_probs(logits[cut], [params[i] for i in cut], vocab)
        groups.append((cut, full, order))
    return groups


def _top_candidates(
    logits: torch.Tensor, params: Sequence[SamplingParams], candidates: int
) -> tuple[torch.Tensor, torch.Tensor, list[bool]]:
    """min_p, top-k and top-p over each row's C most likely tokens (C = `candidates` or the largest top_k):
    (kept probabilities [R, C] in descending order, their token ids, whether each row's result is exact,
    i.e. every token past the C-th is dropped anyway)."""
    dev, vocab = logits.device, logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    # a top-k row's kept set ends inside its k largest; the others look at `candidates`
    c = min(vocab, max(k if k < vocab else candidates for k in top_k))
    vals, ids = torch.topk(logits, c, dim=-1, sorted=True)
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)[:, None]
    # min_p against the most likely token's probability (the full softmax: nothing is dropped before it)
    p_full = torch.exp(vals - lse)
    vals = vals.masked_fill(p_full < min_p * p_full[:, :1], float("-inf"))
    k = torch.tensor(top_k, device=dev)[:, None]
    vals = vals.masked_fill(torch.arange(c, device=dev)[None, :] >= k, float("-inf"))
    # the kept set of min_p and top-k ends inside the candidates when top_k <= c, or when the last
    # candidate is already under min_p; then its softmax is over the candidates, else over the vocabulary
    bounded = (k <= c) | ((min_p > 0) & (p_full[:, -1:] < min_p * p_full[:, :1]))
    norm = torch.where(bounded, torch.logsumexp(vals, dim=-1, keepdim=True), lse)
    probs = torch.exp(vals - norm)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)[:, None]
    before = torch.cumsum(probs, dim=-1) - probs
    kept = probs.masked_fill(before >= top_p, 0.0)
    # an unbounded row (top-p alone) is exact when top-p already drops the token after the last candidate;
    # with min_p its softmax would be over survivors past the candidates: the full sort
    exact = bounded | ((min_p == 0) & (before[:, -1:] + probs[:, -1:] >= top_p))
    return kept, ids, exact[:, 0].tolist()


def _sorted_probs(
    logits: torch.Tensor, params: Sequence[SamplingParams], vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(unnormalized kept probabilities in descending order, the token ids of that order), from a full
    sort of `logits` (already divided by the temperature): the exact fallback of `_top_candidates`."""
    dev = logits.device
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
