"""The SchedulerConfig options the `sglang` preset sets (SGLang 0.5.23's rules), each on its own, without SGLang.

benchmarks/sched/diff_sglang.py compares the whole preset with SGLang's classes (tests/sched/test_diff_sglang.py);
here each rule is checked against the default's on a scenario where the two differ.
"""

from __future__ import annotations

import random

import pytest

from helpers.fake_runner import FakeRunner, check_lifecycles, greedy_reference
from minisched.sched.batch import ForwardMode
from minisched.sched.config import SchedulerConfig
from minisched.sched.policy import SchedulePolicy
from minisched.sched.radix_cache import RadixCache
from minisched.sched.req import Req, ReqStatus
from minisched.sched.sampling_params import SamplingParams
from minisched.sched.scheduler import Scheduler

VOCAB = 50


def make(preset: str = "default", **kw) -> Scheduler:
    base = {"page_size": 1, "num_pages": 400, "max_context_len": 512, "chunk_size": None, "max_prefill_tokens": 4096}
    return Scheduler(SchedulerConfig.preset(preset, **{**base, **kw}))


def add(sched: Scheduler, rid: str, prompt: list[int], max_new: int = 10) -> Req:
    return sched.add_request(rid, prompt, SamplingParams(max_new_tokens=max_new))


def step(sched: Scheduler):
    """One step with a fixed token per row: (mode, [(rid, prefix, extend)])."""
    batch = sched.get_next_batch()
    if batch is None:
        return None, []
    rows = [(r.rid, p, e) for r, p, e in zip(batch.reqs, batch.prefix_lens, batch.extend_lens)]
    sched.process_batch_result(batch, [1] * len(batch.reqs))
    return batch.mode, rows


def ids(rs):
    return [r.rid for r in rs]


def test_sglang_admission_reserves_new_requests_in_full_with_a_page_each():
    # 100 free tokens; each request: a 20-token prompt and 30 new tokens. minisched reserves 30 * 0.7 = 21
    # per admitted request (41 tokens each: 2 fit); SGLang 20 + 30 + 1 page, strict < (1 fits, then
    # 100 - 51 = 49 left: the second needs 51)
    for budget, want in (("minisched", 2), ("sglang", 1)):
        sched = make(num_pages=100, admission_budget=budget)
        for i in range(3):
            add(sched, f"r{i}", [i + 1] * 20, max_new=30)
        mode, rows = step(sched)
        assert mode is ForwardMode.PREFILL and len(rows) == want, (budget, rows)


def test_sglang_admission_has_no_first_request_exemption():
    # a prompt of 60 with 40 new tokens in a pool of 80: minisched admits it (first request, its pages fit);
    # SGLang's check 60 + 40 + 1 < 80 fails, so it waits (a replayed SGLang trace would too)
    for budget, admitted in (("minisched", True), ("sglang", False)):
        sched = make(num_pages=80, admission_budget=budget, max_stalled_steps=1000)
        add(sched, "big", list(range(1, 61)), max_new=40)
        mode, _ = step(sched)
        assert (mode is ForwardMode.PREFILL) == admitted, budget


def test_max_prefill_tokens_with_chunking_off_lets_the_chunk_budget_decide():
    for check, n in ((True, 1), (False, 2)):
        sched = make(chunk_size=64, max_prefill_tokens=30, max_prefill_tokens_with_chunking=check)
        add(sched, "a", [1] * 20)
        add(sched, "b", [2] * 20)
        _, rows = step(sched)
        assert len(rows) == n, (check, rows)


def test_sglang_chunk_rule_floors_a_new_chunk_to_a_page_and_refuses_an_empty_one():
    # 10 chunk tokens left after the first request, pages of 16: minisched runs an unaligned 10-token chunk
    for rule, rows_want in (("minisched", [("a", 0, 54), ("b", 0, 10)]), ("sglang", [("a", 0, 54)])):
        sched = make(page_size=16, num_pages=40, chunk_size=64, chunk_rule=rule)
        add(sched, "a", [1] * 54)
        add(sched, "b", [2] * 40)
        _, rows = step(sched)
        assert rows == rows_want, rule


def test_sglang_chunk_rule_offers_waiting_requests_beside_a_carried_chunk():
    # the carried request's remaining chunk is cut by the KV budget, not the chunk budget: SGLang still
    # offers the next waiting request in that round (here it does not fit either), minisched does not
    sched = make("sglang", num_pages=200, chunk_size=64)
    add(sched, "long", list(range(1, 151)), max_new=5)
    add(sched, "short", [7, 8, 9], max_new=5)
    _, rows = step(sched)
    assert rows == [("long", 0, 64)] and sched.chunked_req is not None
    _, rows = step(sched)
    assert [r[0] for r in rows][0] == "long"
    assert sched.chunked_req is None or sched.chunked_req.rid == "long"


def test_sglang_in_batch_prefix_rule_sorts_shared_prefixes_last_for_lpm():
    tree = RadixCache(1)
    shared = list(range(1, 41))

    def req(rid, prompt):
        return Req(rid=rid, prompt_ids=prompt, sampling=SamplingParams(max_new_tokens=4))

    waiting = [req("a", shared + [1]), req("b", shared + [2]), req("c", [9, 9, 9])]
    pol = SchedulePolicy("lpm", tree, sglang_sort=True, deprioritize_tokens=32)
    assert ids(pol.order(waiting)) == ["a", "c", "b"]  # b shares 40 uncached tokens with a: last
    pol = SchedulePolicy("lpm", tree, sglang_sort=True, deprioritize_tokens=None)
    assert ids(pol.order(waiting)) == ["a", "b", "c"]
    # the default rule defers b in the adder instead (not in the order)
    sched = make(policy="lpm")
    for r in waiting:
        add(sched, r.rid, r.prompt_ids)
    _, rows = step(sched)
    assert [r[0] for r in rows] == ["a", "c"]


def test_in_batch_prefix_rule_sglang_alone_turns_deferral_off():
    """Regression: with minisched's admission path the option was ignored (deferral ran whatever the rule).
    16 cold requests share 64 uncached tokens: deferred, the prefix is computed once; SGLang's rule does not
    skip (FCFS: not even a reordering), so every request computes it."""
    shared = list(range(1, 65))
    for rule, want in (("defer", 64 + 16 * 4), ("sglang", 16 * 68)):
        sched = make(page_size=16, num_pages=400, in_batch_prefix_rule=rule)
        for i in range(16):
            add(sched, f"r{i}", shared + [i + 1] * 4, max_new=2)
        while sched.has_work():
            step(sched)
        assert sum(s.num_prefill_tokens for s in sched.step_stats) == want, rule


def test_in_batch_prefix_rule_sglang_sorts_shared_prefixes_last_in_minischeds_lpm_sort():
    tree = RadixCache(1)
    shared = list(range(1, 41))

    def req(rid, prompt):
        return Req(rid=rid, prompt_ids=prompt, sampling=SamplingParams(max_new_tokens=4))

    waiting = [req("a", shared + [1]), req("b", shared + [2]), req("c", [9, 9, 9])]
    assert ids(SchedulePolicy("lpm", tree, deprioritize_tokens=32).order(waiting)) == ["a", "c", "b"]
    assert ids(SchedulePolicy("lpm", tree).order(waiting)) == ["a", "b", "c"]
    assert ids(SchedulePolicy("fcfs", tree, deprioritize_tokens=32).order(waiting)) == ["a", "b", "c"]


def test_sglang_policy_sort_is_kept_in_the_queue():
    tree = RadixCache(1)
    tree.insert([5, 5, 5, 5], [0, 1, 2, 3])
    sched = make(policy="lof", policy_sort="sglang", max_running_requests=1)
    add(sched, "run", [1, 2], max_new=50)
    step(sched)
    add(sched, "x", [3], max_new=5)
    add(sched, "y", [4], max_new=9)
    step(sched)  # nothing admitted (the batch is full) -- but the sort happened only if a prefill was tried
    add(sched, "z", [6], max_new=9)
    order = sched.policy.order(sched.waiting)
    assert ids(order)[0] in ("y", "z") and ids(order)[-1] == "x"
    # sglang_sort: the returned order is a stable sort of the queue as given
    w = [Req(rid=str(i), prompt_ids=[i + 1], sampling=SamplingParams(max_new_tokens=3)) for i in range(3)]
    assert ids(SchedulePolicy("lof", tree, sglang_sort=True).order(w)) == ["0", "1", "2"]


@pytest.mark.parametrize("budget", ["sglang", "minisched"])
def test_sglang_policy_sort_reorders_the_waiting_queue(budget):
    # regression, minisched's budget: the sort was not kept in the queue outside SGLang's admission path
    for sort, want in (("minisched", ["p", "q"]), ("sglang", ["q", "p"])):
        sched = make(policy="lpm", policy_sort=sort, admission_budget=budget, num_pages=60)
        add(sched, "w", [5] * 10, max_new=1)
        while sched.has_work():
            step(sched)  # [5] * 10 is cached now
        add(sched, "run", [1] * 20, max_new=30)
        step(sched)
        add(sched, "p", [2] * 30, max_new=30)
        add(sched, "q", [5] * 10 + [3] * 20, max_new=30)
        step(sched)
        step(sched)  # a prefill round was tried (alternating rounds: one of the two); neither fits
        assert ids(sched.waiting) == want, (sort, ids(sched.waiting))


def test_dfs_weight_options():
    tree = RadixCache(1)
    tree.insert([1, 1], [0, 1])
    tree.insert([2, 2], [2, 3])

    def req(rid, prompt):
        return Req(rid=rid, prompt_ids=prompt, sampling=SamplingParams(max_new_tokens=3))

    waiting = [req("one", [1, 1, 7]), req("two", [2, 2, 7])]  # equally heavy subtrees
    assert ids(SchedulePolicy("dfs-weight", tree).order(waiting)) == ["two", "one"]
    assert ids(SchedulePolicy("dfs-weight", tree, dfs_ties_reversed=False).order(waiting)) == ["one", "two"]
    assert SchedulePolicy("dfs-weight", tree).active(129) == "fcfs"
    assert SchedulePolicy("dfs-weight", tree, dfs_weight_fallback=False).active(129) == "dfs-weight"
    assert SchedulePolicy("lpm", tree, dfs_weight_fallback=False).active(129) == "fcfs"


def test_aging_off():
    tree = RadixCache(1)
    tree.insert([1, 1, 1], [0, 1, 2])
    cold = Req(rid="cold", prompt_ids=[9, 9], sampling=SamplingParams(max_new_tokens=3))
    hot = Req(rid="hot", prompt_ids=[1, 1, 1, 4], sampling=SamplingParams(max_new_tokens=3))
    cold.overtaken = 100
    assert ids(SchedulePolicy("lpm", tree, aging_rounds=3).order([cold, hot])) == ["cold", "hot"]
    assert ids(SchedulePolicy("lpm", tree, aging_rounds=None).order([cold, hot])) == ["hot", "cold"]
    assert SchedulerConfig(aging_rounds=None).aging_rounds is None
    with pytest.raises(ValueError, match="aging_rounds"):
        SchedulerConfig(aging_rounds=0)


def pressure(preset: str, **kw) -> Scheduler:
    """Four requests that outgrow a 120-token pool while decoding: a retraction is due."""
    sched = make(preset, num_pages=120, **kw)
    for i in range(4):
        add(sched, f"r{i}", [i + 1] * (20 + i), max_new=40)
    return sched


def run_until_retraction(sched: Scheduler) -> list[str]:
    for _ in range(200):
        before = len(sched.events)
        step(sched)
        victims = [e.rid for e in sched.events[before:] if e.dst is ReqStatus.RETRACTED]
        if victims:
            return victims
    raise AssertionError("no retraction")


def test_sglang_retraction_frees_without_caching_and_reestimates_over_max_new_plus_one():
    sched = pressure("default", retraction_rule="sglang", max_prefill_rounds_between_decodes=None)
    cached_before = sched.tree.total_pages
    victims = run_until_retraction(sched)
    assert victims and sched.tree.total_pages <= max(cached_before, sched.tree.total_pages)
    victim = sched.get(victims[0])
    assert victim is not None and victim.output_ids and victim.page_ids == []
    # its decoded tokens were not inserted into the tree
    key = victim.fill_ids
    pages, _ = sched.tree.match_prefix(key)
    assert len(pages) < len(key) - 1
    keep = sched.running
    want = min(1.0, (sum(len(r.output_ids) for r in keep) + 20 * len(keep)) / (sum(40 for _ in keep) + 1))
    assert sched.new_token_ratio == pytest.approx(want)


def test_minisched_retraction_caches_the_victims_decoded_pages():
    sched = pressure("default", max_prefill_rounds_between_decodes=None)
    victims = run_until_retraction(sched)
    victim = sched.get(victims[0])
    assert victim is not None
    pages, _ = sched.tree.match_prefix(victim.fill_ids)
    assert len(pages) >= len(victim.fill_ids) - 1  # prompt and decoded tokens both cached


def test_retracted_to_tail():
    for tail in (False, True):
        sched = pressure("default", retracted_to_tail=tail, max_prefill_rounds_between_decodes=None)
        add(sched, "late", [9] * 90, max_new=5)  # waits: it does not fit beside the others
        victims = run_until_retraction(sched)
        q = ids(sched.waiting)
        assert (q[-len(victims) :] == victims) if tail else (q[: len(victims)] == victims), (tail, q)


@pytest.mark.parametrize("budget", ["sglang", "minisched"])
def test_pause_admission_when_full_waits_for_a_request_to_leave(budget):
    # a request that does not fit sets batch_is_full: with the pause, a small later arrival waits too
    # (regression, minisched's budget: the option was ignored outside SGLang's admission path)
    for pause, admitted in ((False, True), (True, False)):
        sched = make("default", num_pages=100, admission_budget=budget, pause_admission_when_full=pause)
        add(sched, "a", [1] * 30, max_new=20)
        step(sched)
        add(sched, "big", [2] * 40 + ([2] * 40 if budget == "minisched" else []), max_new=20)
        step(sched)  # big does not fit: out of KV with a request running
        add(sched, "small", [3], max_new=1)
        sched.reorder_waiting(sorted(sched.waiting, key=lambda r: r.rid != "small"))
        modes = [step(sched) for _ in range(3)]  # (3: a decode turn of the alternating rounds may come first)
        assert any(rows and rows[0][0] == "small" for _, rows in modes) == admitted, (pause, modes)
        assert sched.get("a") is not None  # it still runs: nothing left the running batch


def test_conservative_eviction_evicts_a_page_per_decode_row():
    # one of two decode rows needs a new page and none is free: minisched evicts one cached page, SGLang's
    # paged decode allocation evicts as if both rows needed one
    for conservative, cached in ((False, 8), (True, 7)):
        sched = make(page_size=4, num_pages=10, conservative_eviction=conservative)
        add(sched, "w1", [1] * 4, max_new=1)
        add(sched, "w2", [2] * 4, max_new=1)
        while sched.has_work():
            step(sched)
        assert sched.tree.total_pages == 2
        add(sched, "a", [3] * 16, max_new=5)
        add(sched, "b", [4] * 14, max_new=5)
        assert [r[0] for r in step(sched)[1]] == ["a", "b"]
        assert step(sched)[0] is ForwardMode.DECODE
        assert sched.tree.total_pages == cached, conservative


def test_conservative_eviction_evicts_a_spare_page_per_extend_row_in_minischeds_admission():
    # regression: with minisched's admission budget the option only reached decode. b's 4 pages fit the 4 free
    # ones exactly; SGLang's paged extend evicts a page beyond them
    for conservative, cached in ((False, 9), (True, 8)):
        sched = make(page_size=4, num_pages=10, conservative_eviction=conservative)
        add(sched, "w1", [1] * 4, max_new=1)
        add(sched, "w2", [2] * 4, max_new=1)
        while sched.has_work():
            step(sched)
        add(sched, "a", [3] * 16, max_new=5)
        add(sched, "b", [4] * 14, max_new=5)
        assert [r[0] for r in step(sched)[1]] == ["a", "b"]
        assert sched.tree.total_pages == cached, conservative


def test_lru_rule_stamps_a_split_tail():
    for touch in (False, True):
        tree = RadixCache(1, touch_split_tail=touch)
        tree.insert([1, 1, 1, 1], [0, 1, 2, 3])
        tree.insert([2, 2], [4, 5])
        tree.match_prefix([1, 1])  # splits [1,1,1,1]; its tail [1,1] is stamped only with touch_split_tail
        assert len(tree.evict(2)) == 2
        left = {tuple(n.key) for n in tree.iter_nodes()}
        assert ((2, 2) in left) == (not touch), (touch, left)  # otherwise the older tail went first


def test_lru_rule_splits_a_cached_sequence_at_its_prompt():
    from minisched.sched.kv_pool import KVPool

    for touch, nodes in ((False, 1), (True, 2)):
        pool, tree = KVPool(8, 1), RadixCache(1, touch_split_tail=touch)
        req = Req(rid="a", prompt_ids=[1] * 4, sampling=SamplingParams(max_new_tokens=4))
        req.output_ids, req.page_ids, req.kv_len = [2] * 4, pool.alloc(8) or [], 8
        tree.cache_finished_req(req, pool)  # prompt and decoded tokens inserted at once (a retracted request)
        assert tree.total_pages == 8 and len(list(tree.iter_nodes())) == nodes, touch


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "dfs-weight", "lof"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_sglang_profile_serves_a_random_workload_correctly(policy, page_size):
    """The preset with arrivals over time and a pool small enough to retract: invariants after every step,
    outputs equal greedy decoding."""
    rng = random.Random(4)
    cfg = SchedulerConfig.preset(
        "sglang", page_size=page_size, num_pages=256 // page_size, max_context_len=512, chunk_size=64, policy=policy
    )
    sched, runner = Scheduler(cfg), FakeRunner(cfg.num_pages or 0, page_size, VOCAB)
    base = [rng.randrange(VOCAB) for _ in range(50)]
    reqs = []
    for i in range(24):
        prompt = base[: rng.randint(0, 50)] + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 60))]
        reqs.append((f"r{i}", prompt, SamplingParams(max_new_tokens=rng.randint(1, 100), ignore_eos=True)))
    done: dict = {}
    for t in range(5000):
        if t % 3 == 0 and t // 3 < len(reqs):
            sched.add_request(*reqs[t // 3])
        elif not sched.has_work() and t // 3 >= len(reqs):
            break
        for req in sched.step(runner):
            done[req.rid] = req
        sched.check_invariants()
    assert {rid: r.output_ids for rid, r in done.items()} == {
        rid: greedy_reference(p, sp.max_new_tokens, VOCAB, (), 512) for rid, p, sp in reqs
    }
    check_lifecycles(sched.events)
    assert sched.num_retracted > 0  # the pool was small enough to retract
