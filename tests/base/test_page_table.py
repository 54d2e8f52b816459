"""Property tests for the page-table arithmetic every op and the scheduler rely on."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from minisched.base.page_table import build_csr, kv_len_of, kv_lens_from_csr, last_page_len, slots_of
from minisched.base.values import cdiv


@given(n=st.integers(1, 10_000), page_size=st.sampled_from([1, 2, 7, 16, 64]))
def test_pages_and_last_len_roundtrip(n, page_size):
    pages, last = cdiv(n, page_size), last_page_len(n, page_size)
    assert 1 <= last <= page_size
    assert (pages - 1) * page_size < n <= pages * page_size
    assert kv_len_of(pages, last, page_size) == n


@settings(max_examples=60)
@given(lens=st.lists(st.integers(1, 200), max_size=12), page_size=st.sampled_from([1, 16]), data=st.data())
def test_csr_describes_each_request(lens, page_size, data):
    counts = [cdiv(n, page_size) for n in lens]
    extra = [data.draw(st.integers(0, 2)) for _ in lens]  # requests may hold spare pages
    pool = np.random.default_rng(0).permutation(sum(counts) + sum(extra) + 1).tolist()
    lists, pos = [], 0
    for c, e in zip(counts, extra):
        lists.append(pool[pos : pos + c + e])
        pos += c + e
    indptr, indices, last = build_csr(lists, lens, page_size)
    assert indptr.dtype == indices.dtype == last.dtype == np.int32
    assert indptr[0] == 0 and indptr[-1] == len(indices) and (np.diff(indptr) >= 1).all()
    assert kv_lens_from_csr(indptr, last, page_size).tolist() == lens
    for b, pages in enumerate(lists):
        assert indices[indptr[b] : indptr[b + 1]].tolist() == pages[: counts[b]]


@given(n=st.integers(1, 300), page_size=st.sampled_from([1, 16]), data=st.data())
def test_slots_are_unique_and_inside_own_pages(n, page_size, data):
    pages = data.draw(
        st.lists(st.integers(0, 999), min_size=cdiv(n, page_size), max_size=cdiv(n, page_size), unique=True)
    )
    start = data.draw(st.integers(0, n - 1))
    slots = slots_of(pages, start, n, page_size)
    assert len(set(slots.tolist())) == n - start
    assert all(s // page_size in pages for s in slots.tolist())
    assert (slots // page_size == np.asarray(pages)[np.arange(start, n) // page_size]).all()


def test_build_csr_csr():
    indptr, indices, last = build_csr([[5, 2, 9], [7], [1, 3]], [9, 4, 5], page_size=4)
    assert indptr.tolist() == [0, 3, 4, 6] and indices.tolist() == [5, 2, 9, 7, 1, 3]
    assert last.tolist() == [1, 4, 1]
    assert indptr.dtype == indices.dtype == last.dtype == np.int32
    # only the pages covering kv_len are used
    indptr, indices, last = build_csr([[5, 2, 9]], [4], page_size=4)
    assert indices.tolist() == [5] and last.tolist() == [4]
