"""The data-parallel router alone (no processes): prefix trees, cache-aware choice, balance fallback, round-robin."""

from __future__ import annotations

import pytest

from minisched.serve.router import NoReplicaError, PrefixTree, Router, RouterConfig


def ids(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_prefix_tree_matches_whole_chunks():
    t = PrefixTree(chunk=4, max_tokens=64)
    t.insert(ids(0, 10))  # two whole chunks; the tail of 2 is not kept
    assert t.num_tokens == 8
    assert t.match(ids(0, 10)) == 8
    assert t.match(ids(0, 7)) == 4
    assert t.match(ids(0, 3)) == 0
    assert t.match([0, 1, 2, 99, 4, 5, 6, 7]) == 0
    assert t.match(ids(0, 4) + [9, 9, 9, 9]) == 4
    t.insert(ids(0, 4) + [9, 9, 9, 9])  # shares the first chunk
    assert t.num_nodes == 3


def test_prefix_tree_evicts_least_recently_used_leaves():
    t = PrefixTree(chunk=2, max_tokens=8)  # 4 nodes
    a, b, c = [1, 1, 2, 2], [3, 3, 4, 4], [5, 5, 6, 6]
    t.insert(a)
    t.insert(b)
    t.insert(a)  # a is now newer than b
    t.insert(c)  # 6 nodes > 4: b (the oldest) goes, leaf first then its parent
    assert t.num_nodes == 4
    assert t.match(a) == 4 and t.match(c) == 4 and t.match(b) == 0
    t.insert(ids(100, 20))  # one prompt longer than the bound keeps its head, loses older paths
    assert t.num_nodes <= 4 + 10
    assert t.match(a) == 0 and t.match(c) == 0
    assert t.match(ids(100, 20)) == 20  # the path just inserted is never evicted by its own insert


def test_cache_aware_sends_shared_prefixes_to_the_same_replica():
    r = Router(RouterConfig(), 2, chunk=4, max_tree_tokens=1024)
    sys_a, sys_b = ids(0, 40), ids(1000, 40)
    first_a = r.route(sys_a + [7, 7])
    first_b = r.route(sys_b + [8, 8])
    assert first_a != first_b  # no match: the replica with the smaller tree takes the new prefix
    for q in range(10):
        assert r.route(sys_a + [q] * 5) == first_a
        assert r.route(sys_b + [q] * 5) == first_b
    assert r.load == [11, 11]


def test_below_the_threshold_the_smallest_tree_wins():
    r = Router(RouterConfig(cache_threshold=0.5), 2, chunk=4, max_tree_tokens=1024)
    assert r.route(ids(0, 40)) == 0
    assert r.route(ids(0, 16) + ids(500, 24)) == 1  # matches 16/40 on replica 0: not enough
    assert r.route(ids(0, 24) + ids(900, 16)) == 0  # matches 24/40 = 0.6 > 0.5


def test_imbalance_falls_back_to_the_least_loaded_replica():
    cfg = RouterConfig(balance_abs_threshold=4, balance_rel_threshold=1.5)
    r = Router(cfg, 2, chunk=4, max_tree_tokens=1024)
    prompt = ids(0, 40)
    assert r.route(prompt) == 0
    for _ in range(4):  # load 5 vs 0: 5 - 0 > 4 and 5 > 1.5 * 0
        assert r.route(prompt) == 0
    assert r.imbalanced()
    assert r.route(prompt) == 1  # cache affinity loses to load
    # the least-loaded pick also learned the prefix, so affinity now ties by load
    assert r.trees[1].match(prompt) == 40
    for _ in range(5):
        r.done(0)
    assert not r.imbalanced()
    assert r.route(prompt) == 0  # balanced again: both match fully, the lighter one (0 now) wins


def test_relative_threshold_alone_does_not_trigger_balance():
    r = Router(RouterConfig(balance_abs_threshold=2, balance_rel_threshold=3.0), 2, chunk=4)
    r.load = [10, 4]  # diff 6 > 2 but 10 < 3 * 4
    assert not r.imbalanced()
    r.load = [13, 4]
    assert r.imbalanced()


def test_round_robin_and_replica_removal():
    r = Router(RouterConfig(policy="round-robin"), 3, chunk=4)
    assert [r.route(ids(0, 40)) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    r.remove(1)
    assert set(r.route(ids(0, 40)) for _ in range(4)) == {0, 2}
    r.remove(0)
    r.remove(2)
    with pytest.raises(NoReplicaError):
        r.route([1, 2, 3])


def test_cache_aware_skips_a_dead_replica_even_with_the_best_match():
    r = Router(RouterConfig(), 2, chunk=4)
    prompt = ids(0, 40)
    assert r.route(prompt) == 0
    r.remove(0)
    assert r.route(prompt) == 1
    assert r.load == [0, 1]


@pytest.mark.parametrize(
    "bad",
    [dict(policy="random"), dict(cache_threshold=1.5), dict(balance_abs_threshold=-1), dict(balance_rel_threshold=0.5)],
)
def test_config_is_validated(bad):
    with pytest.raises(ValueError):
        RouterConfig(**bad)
