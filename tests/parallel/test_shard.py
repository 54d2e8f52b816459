"""Sharding without processes: the plan for every head layout, the packed step message, and the
sharded forward of T ranks -- run as T threads over an in-process group -- against the full model."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from minisched.base.page_table import build_csr, slots_of
from minisched.model import weights
from minisched.model.config import preset
from minisched.model.llama import CascadeMeta, ForwardMeta, LlamaModel
from minisched.parallel import protocol
from minisched.parallel.shard import ShardPlan, check_tp, shard_model


def layouts():
    """Every (Hq, Hkv, T) with Hq <= 12 that tensor parallelism accepts."""
    out = []
    for hq in range(1, 13):
        for hkv in (h for h in range(1, hq + 1) if hq % h == 0):
            for t in range(2, hq + 1):
                if hq % t == 0 and (hkv % t == 0 or t % hkv == 0):
                    out.append((hq, hkv, t))
    return out


@pytest.mark.parametrize("hq,hkv,t", layouts())
def test_plan_gives_each_rank_the_kv_heads_its_query_heads_read(hq, hkv, t):
    cfg = preset("tiny", num_heads=hq, num_kv_heads=hkv, intermediate_size=27720, vocab_size=101)  # lcm(1..12)
    group = hq // hkv
    plans = [ShardPlan.of(cfg, r, t) for r in range(t)]
    assert [p.q_heads for p in plans] == [(r * hq // t, (r + 1) * hq // t) for r in range(t)]
    for p in plans:
        local = p.local_config(cfg)  # validates Hq_local % Hkv_local == 0
        local_group = local.num_heads // local.num_kv_heads
        for i, head in enumerate(range(*p.q_heads)):  # local GQA maps each query head to the right KV head
            assert p.kv_heads[0] + i // local_group == head // group
    if hkv >= t:  # split: every KV head on exactly one rank
        assert sorted(h for p in plans for h in range(*p.kv_heads)) == list(range(hkv))
    else:  # replicated: one KV head per rank, each on t / hkv ranks
        assert all(p.kv_heads[1] - p.kv_heads[0] == 1 for p in plans)
    rows = plans[0].vocab_rows
    assert rows * t >= 101 and (rows - 1) * t < 101 and plans[-1].vocab == ((t - 1) * rows, t * rows)


@pytest.mark.parametrize(
    "kw,t,match",
    [
        (dict(num_heads=9, num_kv_heads=3), 2, "must divide the model's 9 query heads"),
        (dict(num_heads=12, num_kv_heads=4), 3, "4 KV heads"),
        (dict(num_heads=4, num_kv_heads=2, intermediate_size=250), 4, "MLP size 250"),
    ],
)
def test_impossible_splits_are_one_line_errors(kw, t, match):
    with pytest.raises(ValueError, match=match):
        check_tp(preset("tiny", **kw), t)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="must be an int >= 1"):
            check_tp(preset("tiny"), bad)


def test_pack_unpack_round_trip_with_cascade():
    g = torch.Generator().manual_seed(0)

    def ints(n, dtype=torch.int32):
        return torch.randint(0, 1000, (n,), generator=g).to(dtype)

    meta = ForwardMeta(
        positions=ints(5, torch.int64),
        out_slots=ints(5),
        qo_indptr=ints(4),
        page_table=(ints(4), ints(9), ints(3)),
        logits_indices=ints(3, torch.int64),
        is_decode=True,
        cascade=CascadeMeta(
            rows=ints(2, torch.int64),
            group_indptr=ints(2),
            prefix_table=(ints(2), ints(3), ints(1)),
            suffix_table=(ints(3), ints(4), ints(2)),
            plain_rows=ints(1, torch.int64),
            plain_table=(ints(2), ints(1), ints(1)),
        ),
    )
    ids = ints(5)
    for m in (meta, ForwardMeta(meta.positions, meta.out_slots, meta.qo_indptr, meta.page_table, meta.logits_indices)):
        h, payload = protocol.pack_step(ids, m)
        assert h.shape == (protocol.HEADER_LEN,) and payload.dtype == torch.int32 and payload.dim() == 1
        assert payload.numel() == protocol.payload_len(h.tolist())
        ids2, m2 = protocol.unpack_step(h.tolist(), payload.clone())
        assert torch.equal(ids2, ids) and m2.is_decode == m.is_decode
        for a, b in zip(protocol._fields(ids, m), protocol._fields(ids2, m2)):
            assert a.dtype == b.dtype and torch.equal(a, b)
        assert (m2.cascade is None) == (m.cascade is None)


class ThreadGroup:
    """T ranks as T threads of this process: each collective is a barrier over shared slots."""

    def __init__(self, world: int):
        self.world = world
        self.barrier = threading.Barrier(world, timeout=60)
        self.slots: list = [None] * world

    def rank(self, r: int) -> ThreadRank:
        return ThreadRank(self, r)


class ThreadRank:
    def __init__(self, shared: ThreadGroup, rank: int):
        self.shared, self.rank, self.world = shared, rank, shared.world
        self.reduced_bytes = 0

    def _exchange(self, t):
        s = self.shared
        s.slots[self.rank] = t.clone()
        s.barrier.wait()
        got = list(s.slots)
        s.barrier.wait()
        return got

    def all_reduce(self, t):
        got = self._exchange(t)
        self.reduced_bytes += t.numel() * t.element_size()
        t.copy_(sum(got[1:], got[0].clone()))  # rank order: every rank the same bytes
        return t

    def gather(self, t, dst: int = 0):
        got = self._exchange(t)
        return got if self.rank == dst else None


def run_ranks(world, fn):
    """fn(group) on `world` threads, each with its rank's ThreadRank; the results in rank order
    (an exception in any thread is raised here, after the others were released)."""
    shared = ThreadGroup(world)
    out, errors = [None] * world, []

    def body(r):
        try:
            out[r] = fn(shared.rank(r))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            shared.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    if errors:
        raise errors[0]
    return out


def ragged_batch(seqs, cached, page_size):
    """ids + ForwardMeta computing seqs[b][cached[b]:] on top of an already stored prefix."""
    pages, at = [], 0
    for s in seqs:
        n = -(-len(s) // page_size)
        pages.append(list(range(at, at + n)))
        at += n
    starts, ends = cached, [len(s) for s in seqs]
    ids = torch.tensor([t for s, a, e in zip(seqs, starts, ends) for t in s[a:e]])
    qo = np.concatenate([[0], np.cumsum([e - a for a, e in zip(starts, ends)])]).astype(np.int32)
    meta = ForwardMeta(
        positions=torch.cat([torch.arange(a, e) for a, e in zip(starts, ends)]),
        out_slots=torch.from_numpy(
            np.concatenate([slots_of(p, a, e, page_size) for p, a, e in zip(pages, starts, ends)])
        ),
        qo_indptr=torch.from_numpy(qo),
        page_table=tuple(torch.from_numpy(a) for a in build_csr(pages, ends, page_size)),
        logits_indices=torch.from_numpy(qo[1:] - 1).long(),
    )
    return ids, meta, at


@pytest.mark.parametrize("hq,hkv,t", [(4, 2, 2), (2, 1, 2), (6, 6, 3), (9, 3, 3), (8, 2, 4), (12, 4, 2)])
@pytest.mark.parametrize("tied", [True, False])
def test_sharded_forward_equals_the_full_model(hq, hkv, t, tied):
    cfg = preset(
        "tiny", num_heads=hq, num_kv_heads=hkv, intermediate_size=48 * t, vocab_size=101 + t, tie_embeddings=tied
    )
    c, state = weights.dummy_weights(cfg, seed=3)
    for k in state:
        if k.endswith("_proj.weight"):
            state[k] *= 10  # the layers matter for the logits (see ModelSource.weight_scale)
    full = LlamaModel.from_state_dict(c, state)
    seqs = [list(np.random.default_rng(b).integers(0, cfg.vocab_size, n)) for b, n in enumerate([9, 1, 20])]
    page_size = 4
    ids1, meta1, pages = ragged_batch(seqs, [0, 0, 0], page_size)
    ids2, meta2, _ = ragged_batch([s + [7, 8] for s in seqs], [len(s) for s in seqs], page_size)

    def forward(model, kv):
        first = model(ids1, meta1, kv)
        return first, model(ids2, meta2, kv)  # reads the prefix written by the first pass

    kv = full.new_kv_cache(pages + 3, page_size)
    ref1, ref2 = forward(full, kv)

    def rank(group):
        shard = shard_model(full, group)
        local_kv = shard.new_kv_cache(pages + 3, page_size)
        kv0, kv1 = ShardPlan.of(cfg, group.rank, t).kv_heads
        assert local_kv.shape[-2] == shard.cfg.num_kv_heads == kv1 - kv0  # the pool holds this rank's heads
        return forward(shard, local_kv), group.reduced_bytes, local_kv

    results = run_ranks(t, rank)
    (tp1, tp2), reduced, _ = results[0]
    assert all(res[0][0] is None and res[0][1] is None for res in results[1:])  # logits only on rank 0
    assert tp1.shape == ref1.shape and tp2.shape == ref2.shape
    torch.testing.assert_close(tp1, ref1, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(tp2, ref2, atol=2e-4, rtol=1e-4)
    assert torch.equal(tp2.argmax(-1), ref2.argmax(-1))
    n_tokens = ids1.numel() + ids2.numel()  # embedding + O + down, per token, float32
    assert reduced == n_tokens * cfg.hidden_size * 4 * (1 + 2 * cfg.num_layers)
