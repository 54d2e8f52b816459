"""Radix cache over whole pages: matching, splitting, insert accounting, LRU eviction, locks."""

from __future__ import annotations

import random

import pytest

from minisched.sched.kv_pool import KVPool
from minisched.sched.radix_cache import RadixCache


def test_empty_and_disabled():
    tree = RadixCache(4)
    assert tree.match_prefix([1, 2, 3, 4]) == ([], tree.root)
    off = RadixCache(4, disable=True)
    assert off.insert([1, 2, 3, 4], [0]) == []
    assert off.match_prefix([1, 2, 3, 4])[0] == [] and off.total_pages == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_insert_match_split(page_size):
    ps = page_size
    tree = RadixCache(ps)
    key = list(range(4 * ps))
    assert tree.insert(key, [10, 11, 12, 13]) == []
    assert tree.evictable_pages == 4
    pages, node = tree.match_prefix(key)
    assert pages == [10, 11, 12, 13]
    # a partial match splits the node at a page boundary
    other = key[: 2 * ps] + [999] * (2 * ps)
    pages, node = tree.match_prefix(other)
    assert pages == [10, 11] and len(node.key) == 2 * ps and len(node.children) == 1
    tree.check()
    # the divergent key shares the tree's own pages 10, 11: nothing to free
    assert tree.insert(other, [10, 11, 20, 21]) == []
    assert tree.total_pages == 6
    assert tree.match_prefix(other)[0] == [10, 11, 20, 21]
    assert tree.match_prefix(key)[0] == [10, 11, 12, 13]
    tree.check()


def test_page_alignment():
    tree = RadixCache(4)
    tree.insert(list(range(10)), [0, 1, 2])  # only 2 full pages of key are usable
    assert tree.total_pages == 2
    assert tree.match_prefix(list(range(7)))[0] == [0]  # 7 tokens -> 1 full page
    assert tree.match_prefix([0, 1, 2, 3, 4, 5, 9, 9])[0] == [0]  # mismatch inside page 2
    tree.check()


def test_insert_returns_the_duplicate_pages():
    tree = RadixCache(2)
    assert tree.insert([1, 2, 3, 4], [5, 6]) == []
    assert tree.insert([1, 2, 3, 4, 5, 6], [7, 8, 9]) == [7, 8]  # the caller frees them
    assert tree.match_prefix([1, 2, 3, 4, 5, 6])[0] == [5, 6, 9]
    assert tree.insert([1, 2], [3]) == [3]
    assert tree.total_pages == 3


def test_lru_eviction_order_and_cascade():
    tree = RadixCache(1)
    tree.insert([1, 2], [0, 1])
    tree.insert([3, 4], [2, 3])
    tree.insert([1, 2, 5], [0, 1, 4])
    tree.match_prefix([3, 4])  # [3, 4] is now the most recent
    freed = tree.evict(1)
    assert freed == [4]  # leaf [5] under [1, 2]: oldest leaf
    freed = tree.evict(2)
    assert freed == [0, 1]  # [1, 2] became a leaf and is older than [3, 4]
    assert tree.evictable_pages == 2 and tree.match_prefix([1, 2])[0] == []
    assert sorted(tree.evict(100)) == [2, 3] and tree.total_pages == 0
    tree.check()


def test_locks_protect_and_move_sizes():
    tree = RadixCache(1)
    tree.insert([1, 2, 3], [0, 1, 2])
    tree.insert([1, 2, 4], [0, 1, 3])
    _, node = tree.match_prefix([1, 2, 3])
    tree.inc_lock_ref(node)
    assert (tree.evictable_pages, tree.protected_pages) == (1, 3)
    tree.check({id(node): 1, id(node.parent): 1})
    assert tree.evict(10) == [3]  # only the unlocked leaf
    tree.inc_lock_ref(node)
    tree.dec_lock_ref(node)
    tree.dec_lock_ref(node)
    assert (tree.evictable_pages, tree.protected_pages) == (3, 0)
    with pytest.raises(RuntimeError):
        tree.dec_lock_ref(node)
    tree.check()
    assert sorted(tree.evict(10)) == [0, 1, 2]


def test_lock_survives_split():
    tree = RadixCache(1)
    tree.insert([1, 2, 3, 4], [0, 1, 2, 3])
    _, node = tree.match_prefix([1, 2, 3, 4])
    tree.inc_lock_ref(node)
    tree.match_prefix([1, 2, 9])  # splits the locked node
    tree.check()
    assert tree.protected_pages == 4
    tree.dec_lock_ref(node)
    assert tree.evictable_pages == 4
    tree.check({})


@pytest.mark.parametrize("page_size", [1, 4])
def test_random_against_dict(page_size):
    """Random inserts/matches/evictions keep the accounting and the pages consistent."""
    rng = random.Random(page_size)
    ps = page_size
    pool = KVPool(400, ps)
    tree = RadixCache(ps)
    content: dict[int, tuple] = {}  # page -> the token prefix it holds (whole key up to its end)
    for _ in range(300):
        n = rng.randint(1, 6) * ps
        key = [rng.randint(0, 2) for _ in range(n)]
        cached, _ = tree.match_prefix(key)
        for i, p in enumerate(cached):
            assert content[p] == tuple(key[: (i + 1) * ps])
        new = pool.alloc(n // ps - len(cached))
        if new is None:
            pool.free(tree.evict(n // ps))
            continue
        pages = cached + new
        assert tree.insert(key, pages) == []  # its cached pages are the tree's own
        for i, p in enumerate(new):
            content[p] = tuple(key[: (len(cached) + i + 1) * ps])
        tree.check()
        assert pool.num_free + tree.total_pages == 400
