"""Differential test: minisched's Scheduler against SGLang 0.5.23's own scheduling classes.

Each random trace (seeded: arrivals over steps with prompts sharing prefixes, output lengths, aborts of
queued requests, a pool small enough to retract) is fed step by step to `SGLangReplica`
(sglang_replica.py: SGLang's SchedulePolicy, PrefillAdder, ScheduleBatch, RadixCache and allocators)
and to minisched's `Scheduler` with a fake runner; both sample the same deterministic "model" (a hash
of each request's history). At each step the harness compares: prefill or decode; the batch's rows
(admitted requests in order, each one's prefix and extend length); the chunked request carried on;
the retraction victims; `new_token_ratio`; the tokens the radix cache holds (matched prefixes and
evictions show there). It stops a trace at the first differing decision (after one the two runs are
no longer comparable) and prints both sides' state for the first few; the summary counts the traces
that differ per policy x page size and a histogram of the first differences' kinds, each mapped to
the known SGLang-vs-minisched rule difference it most likely confirms (docs/architecture.md, "Scheduler decisions beyond SGLang's").

Requests do not set `ignore_eos` (and the fake model's tokens never stop one: no stop ids): SGLang 0.5.23
reserves an `ignore_eos` request's future tokens at ratio 1.0 (`_get_running_request_total_token_offset`)
where minisched applies `new_token_ratio`, and with the radix cache off it admits them by another path
(`add_one_req_ignore_eos`); both would hide the default rules. Aborts: only of requests still queued on both sides (an abort of a running request finishes it at
SGLang's next result, a path this harness does not drive).

    make sglang-env                    # once: SGLang 0.5.23 in its own environment
    make diff-sglang                   # or:
    $(SGLANG_PY) benchmarks/sched/diff_sglang.py --traces 100 [--policy lpm] [--page-size 16] [--profile NAME]

Exit status: 0 (differences are results, not failures), 2 on bad options.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sched_decision import Decision  # noqa: E402

from minisched.sched.batch import ForwardMode  # noqa: E402
from minisched.sched.config import SchedulerConfig  # noqa: E402
from minisched.sched.req import ReqStatus  # noqa: E402
from minisched.sched.sampling_params import SamplingParams
from minisched.sched.scheduler import Scheduler  # noqa: E402

POLICIES = ("fcfs", "lpm", "dfs-weight", "lof")
PAGE_SIZES = (1, 16)
VOCAB = 50
CONTEXT = 1024

# first-difference kind -> the known SGLang-vs-minisched rule difference it most likely confirms (docs/architecture.md, "Scheduler decisions beyond SGLang's")
ROWS = {
    "decode-instead-of-prefill": "prefill-first vs alternating prefill and decode rounds",
    "prefill-instead-of-decode": "admission budget (reservation / first-request exemption / page overhead)",
    "prefill-vs-idle": "admission budget (reservation / first-request exemption / page overhead)",
    "admitted-more": "admission budget: ratio applied to new requests / chunk pages only / `<=`",
    "admitted-fewer": "admission budget: reservation in full / whole remaining prompt / strict `<`",
    "admitted-other": "policy order (aging, fallbacks, DFS ties) or in-batch prefix rule",
    "order": "policy order (aging, fallbacks, DFS ties) or retracted requests' queue position",
    "extend-len": "chunk length (page floor, max_prefill_tokens with chunking)",
    "prefix-len": "radix cache match (retraction inserting into the tree, evictions)",
    "chunked": "chunked request (add_chunked_req progress, truncation)",
    "retracted": "retraction (at least one victim, stop rule)",
    "ratio-after-retraction": "ratio after retraction (+1, unclipped)",
    "ratio": "new_token_ratio decay",
    "cache": "radix cache contents (retraction inserting into the tree, evictions)",
    "crash": "a side raised",
}


def next_token(history) -> int:
    """The fake model (as tests/helpers/fake_runner.py): a hash of the whole history."""
    h = list(history)
    return (sum(h) * 7 + h[-1] * 13 + len(h) * 5) % VOCAB


# -- traces -----------------------------------------------------------------------
@dataclasses.dataclass
class Trace:
    seed: int
    policy: str
    page_size: int
    pool_tokens: int
    max_running: int
    max_prefill: int
    chunk: int | None
    arrivals: dict  # step -> [(rid, prompt, max_new)]
    aborts: dict  # step -> [rid]
    last_step: int


def make_trace(seed: int, policy: str, page_size: int) -> Trace:
    rng = random.Random(seed)
    ps = page_size
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randint(4, 80))] for _ in range(rng.randint(1, 3))]
    arrivals, aborts = collections.defaultdict(list), collections.defaultdict(list)
    n = rng.randint(3, 14)
    horizon = rng.randint(0, 30)
    longest = 0
    for i in range(n):
        step = rng.randint(0, horizon)
        prefix = rng.choice(prefixes) if rng.random() < 0.7 else []
        prompt = prefix + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 60))]
        max_new = rng.randint(1, 48)
        arrivals[step].append((f"r{i}", prompt, max_new))
        longest = max(longest, len(prompt) + max_new)
        if rng.random() < 0.12:
            aborts[step + rng.randint(0, 6)].append(f"r{i}")
    # a pool between one longest request (plus slack) and a few: small enough to retract
    pages = -(-(longest + 2 * ps) // ps) + rng.randint(0, 3 * 160 // ps)
    chunk = rng.choice([None, 32, 64, 128]) if ps == 1 else rng.choice([None, 32, 64, 128])
    return Trace(
        seed=seed,
        policy=policy,
        page_size=ps,
        pool_tokens=pages * ps,
        max_running=rng.randint(2, 12),
        max_prefill=rng.choice([64, 128, 256, 4096]),
        chunk=chunk,
        arrivals=dict(arrivals),
        aborts=dict(aborts),
        last_step=horizon + 6,
    )


# -- minisched's side --------------------------------------------------------------
def profile_config(profile: str, **fields) -> SchedulerConfig:
    return SchedulerConfig.preset(profile, **fields)


def parse_overrides(items: list[str]) -> dict:
    """`FIELD=VALUE` pairs (VALUE a Python literal: None, 1, 0.5, True) over the profile's config."""
    import ast

    fields = {f.name for f in dataclasses.fields(SchedulerConfig)}
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in fields:
            raise ValueError(f"--set {item!r}: want FIELD=VALUE with FIELD a SchedulerConfig field")
        try:
            out[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ValueError(f"--set {item!r}: {value!r} is not a literal") from None
    return out


class MiniSide:
    def __init__(self, t: Trace, profile: str, overrides: dict | None = None) -> None:
        cfg = profile_config(
            profile,
            **(overrides or {}),
            page_size=t.page_size,
            num_pages=t.pool_tokens // t.page_size,
            max_context_len=CONTEXT,
            chunk_size=t.chunk,
            max_prefill_tokens=t.max_prefill,
            max_running_requests=t.max_running,
            policy=t.policy,
        )
        self.sched = Scheduler(cfg)
        self.seen_events = 0

    def add_request(self, rid: str, prompt: list[int], max_new: int) -> None:
        self.sched.add_request(rid, prompt, SamplingParams(max_new_tokens=max_new))

    def is_waiting(self, rid: str) -> bool:
        req = self.sched.reqs.get(rid)
        return req is not None and req.status is ReqStatus.WAITING

    def abort(self, rid: str) -> None:
        self.sched.abort(rid)

    def step(self) -> Decision:
        s = self.sched
        batch = s.get_next_batch()
        new = s.events[self.seen_events :]
        retracted = [e.rid for e in new if e.dst is ReqStatus.RETRACTED]
        cached = s.tree.total_pages * s.config.page_size
        ratio = s.new_token_ratio
        chunked = None if s.chunked_req is None else s.chunked_req.rid
        if batch is None:
            finished = s.take_finished()
            self.seen_events = len(s.events)
            return Decision("idle", [], chunked, retracted, ratio, cached, [r.rid for r in finished])
        rows = [(r.rid, p, e) for r, p, e in zip(batch.reqs, batch.prefix_lens, batch.extend_lens)]
        mode = "decode" if batch.mode is ForwardMode.DECODE else "prefill"
        tokens = [
            next_token(r.fill_ids[: p + e]) if sampled else 0
            for r, p, e, sampled in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, batch.sampled)
        ]
        finished = s.process_batch_result(batch, tokens)
        self.seen_events = len(s.events)
        return Decision(mode, rows, chunked, retracted, ratio, cached, [r.rid for r in finished])

    def has_work(self) -> bool:
        return self.sched.has_work()


# -- comparison -------------------------------------------------------------------
def first_difference(sg: Decision, ms: Decision) -> str | None:
    if sg.retracted != ms.retracted:
        return "retracted"
    if sg.mode != ms.mode:
        if sg.mode == "prefill" and ms.mode == "decode":
            return "decode-instead-of-prefill"
        if sg.mode == "decode" and ms.mode == "prefill":
            return "prefill-instead-of-decode"
        return "prefill-vs-idle"
    if sg.rows != ms.rows:
        sr, mr = [r[0] for r in sg.rows], [r[0] for r in ms.rows]
        if sr == mr:
            same_ext = [r[2] for r in sg.rows] == [r[2] for r in ms.rows]
            return "prefix-len" if same_ext else "extend-len"
        if sorted(sr) == sorted(mr):
            return "order"
        if set(sr) < set(mr):
            return "admitted-more"
        if set(mr) < set(sr):
            return "admitted-fewer"
        return "admitted-other"
    if sg.chunked != ms.chunked:
        return "chunked"
    if abs(sg.ratio - ms.ratio) > 1e-9:
        return "ratio-after-retraction" if sg.retracted else "ratio"
    if sg.cached_tokens != ms.cached_tokens:
        return "cache"
    return None


@dataclasses.dataclass
class Outcome:
    steps: int
    kind: str | None
    step: int = -1
    detail: str = ""


def run_trace(t: Trace, profile: str, overrides: dict | None = None, max_steps: int = 2000) -> Outcome:
    from sglang_replica import SGLangReplica  # imports SGLang (~20 s): only once the options are good

    sg = SGLangReplica(
        policy=t.policy,
        page_size=t.page_size,
        pool_tokens=t.pool_tokens,
        max_running_requests=t.max_running,
        max_prefill_tokens=t.max_prefill,
        chunk_size=t.chunk,
        context_len=CONTEXT,
        next_token=next_token,
    )
    ms = MiniSide(t, profile, overrides)
    for step in range(max_steps):
        for rid, prompt, max_new in t.arrivals.get(step, ()):
            sg.add_request(rid, prompt, max_new)
            ms.add_request(rid, prompt, max_new)
        for rid in t.aborts.get(step, ()):
            if sg.is_waiting(rid) and ms.is_waiting(rid):
                sg.abort_waiting(rid)
                ms.abort(rid)
        if step > t.last_step and not sg.has_work() and not ms.has_work():
            return Outcome(step, None)
        try:
            a = sg.step()
        except Exception as exc:  # noqa: BLE001 (a result: SGLang's side raised on this trace)
            return Outcome(step, "crash", step, f"sglang: {type(exc).__name__}: {exc}")
        try:
            b = ms.step()
        except Exception as exc:  # noqa: BLE001
            return Outcome(step, "crash", step, f"minisched: {type(exc).__name__}: {exc}")
        kind = first_difference(a, b)
        if kind is not None:
            return Outcome(step, kind, step, f"  sglang:    {a}\n  minisched: {b}\n" + state(sg, ms))
    return Outcome(max_steps, "crash", max_steps, "no end after max_steps")


def state(sg, ms: MiniSide) -> str:
    s = ms.sched
    return (
        f"  sglang    waiting {[r.rid for r in sg.waiting]} running {[r.rid for r in sg.running.reqs]}"
        f" free {sg.alloc.available_size()} evictable {sg.tree.evictable_size()}\n"
        f"  minisched waiting {[r.rid for r in s.waiting]} running {[r.rid for r in s.running]}"
        f" free {s.pool.num_free * s.config.page_size} evictable {s.tree.evictable_pages * s.config.page_size}"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", type=int, default=100, help="traces per policy x page size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy", choices=POLICIES, action="append", help="(repeatable) default: all four")
    ap.add_argument("--page-size", type=int, choices=PAGE_SIZES, action="append", help="(repeatable) default: 1 and 16")
    ap.add_argument("--profile", default="default", help="a SchedulerConfig preset name (default: the default config)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a config field")
    ap.add_argument("--show", type=int, default=2, help="print both sides' state for this many differences per cell")
    ap.add_argument("--json", help="write the summary here")
    args = ap.parse_args(argv)
    if args.traces < 1:
        ap.error("--traces must be >= 1")
    try:
        overrides = parse_overrides(args.set)
        profile_config(args.profile, **overrides)
    except ValueError as exc:
        ap.error(str(exc))
    policies, sizes = args.policy or list(POLICIES), args.page_size or list(PAGE_SIZES)
    t0 = time.perf_counter()
    kinds: collections.Counter = collections.Counter()
    cells, total_steps, differing = {}, 0, 0
    for policy in policies:
        for ps in sizes:
            shown, diff, cell_kinds = 0, 0, collections.Counter()
            for i in range(args.traces):
                seed = args.seed * 1_000_003 + i
                t = make_trace(seed, policy, ps)
                out = run_trace(t, args.profile, overrides)
                total_steps += out.steps
                if out.kind is None:
                    continue
                diff += 1
                cell_kinds[out.kind] += 1
                if shown < args.show:
                    shown += 1
                    print(f"[{policy} ps={ps} seed={seed}] step {out.step}: {out.kind}\n{out.detail}")
            kinds += cell_kinds
            differing += diff
            cells[f"{policy}/ps{ps}"] = {"traces": args.traces, "differ": diff, "kinds": dict(cell_kinds)}
            print(f"{policy:>10} ps={ps:<2}: {diff}/{args.traces} traces differ  {dict(cell_kinds)}")
    n = args.traces * len(policies) * len(sizes)
    print(
        f"\n{n} traces ({total_steps} steps compared, {time.perf_counter() - t0:.1f} s), profile {args.profile} {overrides or ''}: "
        f"{differing} differ"
    )
    for kind, c in kinds.most_common():
        print(f"  {c:5d}  {kind:<26} -> {ROWS[kind]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "profile": args.profile,
                    "traces": n,
                    "differ": differing,
                    "steps": total_steps,
                    "kinds": dict(kinds),
                    "cells": cells,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
