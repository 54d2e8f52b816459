"""KV page pool, request page tables and the Batch arrays (CPU, no torch in the code under test)."""

from __future__ import annotations

import pytest

from minisched.base.values import cdiv
from minisched.sched.batch import Batch, ForwardMode
from minisched.sched.kv_pool import KVPool
from minisched.sched.req import Req
from minisched.sched.sampling_params import SamplingParams


def make_req(n_prompt: int, rid: str = "r") -> Req:
    return Req(rid=rid, prompt_ids=list(range(100, 100 + n_prompt)), sampling=SamplingParams())


def test_alloc_free_roundtrip():
    pool = KVPool(8, 4)
    a = pool.alloc(3)
    b = pool.alloc(5)
    assert sorted(a + b) == list(range(8)) and pool.num_free == 0
    assert pool.alloc(1) is None  # all-or-nothing
    pool.free(a)
    assert pool.num_free == 3 and pool.alloc(4) is None
    assert sorted(pool.alloc(3)) == sorted(a)


def test_double_free_and_bad_page_raise():
    pool = KVPool(4, 2)
    p = pool.alloc(1)
    pool.free(p)
    with pytest.raises(RuntimeError):
        pool.free(p)
    with pytest.raises(RuntimeError):
        pool.free([99])
    with pytest.raises(ValueError):
        KVPool(0, 4)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_alloc_for_extend_reuses_partial_page(page_size):
    pool = KVPool(64, page_size)
    req = make_req(10)
    assert pool.alloc_for_extend(req, 7)
    req.kv_len = 7
    assert len(req.page_ids) == cdiv(7, page_size)
    before = list(req.page_ids)
    assert pool.alloc_for_extend(req, 3)
    req.kv_len = 10
    assert req.page_ids[: len(before)] == before and len(req.page_ids) == cdiv(10, page_size)
    assert pool.num_free == 64 - cdiv(10, page_size)
    assert pool.slots(req, 0, 10) == [req.page_ids[i // page_size] * page_size + i % page_size for i in range(10)]


def test_alloc_for_extend_fails_cleanly():
    pool = KVPool(2, 4)
    req = make_req(20)
    assert not pool.alloc_for_extend(req, 12)
    assert req.page_ids == [] and pool.num_free == 2


@pytest.mark.parametrize("page_size", [1, 16])
def test_alloc_for_decode(page_size):
    pool = KVPool(32, page_size)
    reqs = [make_req(5, f"r{i}") for i in range(3)]
    for r, n in zip(reqs, [page_size, page_size + 1, 2 * page_size - 1]):
        pool.alloc_for_extend(r, n)
        r.kv_len = n
    need = pool.decode_pages_needed(reqs)
    assert need == sum(1 for r in reqs if r.kv_len % page_size == 0)
    free = pool.num_free
    assert pool.alloc_for_decode(reqs)
    assert pool.num_free == free - need
    for r in reqs:
        assert len(r.page_ids) == cdiv(r.kv_len + 1, page_size)
    tiny = KVPool(1, page_size)
    r = make_req(1)
    tiny.alloc_for_extend(r, page_size)
    r.kv_len = page_size
    assert not tiny.alloc_for_decode([r]) and len(r.page_ids) == 1


def test_batch_arrays():
    ps = 4
    pool = KVPool(16, ps)
    a, b = make_req(6, "a"), make_req(3, "b")
    b.output_ids = [7]
    pool.alloc_for_extend(a, 6)  # prefill a: 6 new tokens
    pool.alloc_for_extend(b, 3)
    b.kv_len = 3
    pool.alloc_for_extend(b, 1)  # decode b: its output token at position 3
    batch = Batch(mode=ForwardMode.MIXED, reqs=[a, b], prefix_lens=[0, 3], extend_lens=[6, 1], page_size=ps)
    assert batch.input_ids().tolist() == a.prompt_ids + [7]
    assert batch.positions().tolist() == [0, 1, 2, 3, 4, 5, 3]
    assert batch.qo_indptr().tolist() == [0, 6, 7]
    assert batch.logits_indices().tolist() == [5, 6]
    assert batch.sample_mask().tolist() == [True, True]
    slots = batch.out_slots().tolist()
    assert slots[:6] == pool.slots(a, 0, 6) and slots[6] == b.page_ids[0] * ps + 3
    indptr, indices, last = batch.page_table()
    assert indptr.tolist() == [0, 2, 3] and last.tolist() == [2, 4]
    part = Batch(
        mode=ForwardMode.PREFILL, reqs=[a], prefix_lens=[0], extend_lens=[4], page_size=ps
    )  # a chunk that does not finish the prompt
    assert part.sample_mask().tolist() == [False]
    assert (
        Batch(mode=ForwardMode.DECODE, reqs=[], prefix_lens=[], extend_lens=[], page_size=ps).positions().tolist() == []
    )
