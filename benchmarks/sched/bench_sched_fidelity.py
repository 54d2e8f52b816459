"""Scheduler fidelity benchmark: counted in steps and tokens with a fake runner, so
the numbers do not depend on the machine. Not a test.

Scenarios (each a function below returning one dict of metrics):

- deferral-64: 64 requests share a 512-token system prompt (+ 64 own tokens), chunk 8,192;
  deferral-16: 16 cold requests share 1,024 tokens (+ 32 own), no chunking: prefill tokens.
- arrivals: one 256-token arrival per step for 200 steps over 8 long decodes: the gap between
  a running request's tokens (TPOT in steps, p50 / p99 / max), TTFT in steps, total steps.
- long-prompt: an 8,000-token prompt arrives while 8 requests decode: the longest decode gap.
- mixed-budget: mixed chunks, 64 decoding + a long prompt, chunk 512: largest batch in tokens.
- retraction / retraction-full: 256 requests (64-256 prompt tokens) on a 4,096 / 8,192-token pool,
  answers ending by a stop token (mean 300 of max 1,024) / running to max_new_tokens
  (256-1,024): retracted requests, prefill tokens recomputed, steps, mean decode batch.
- huge-max-new: 512-token context, 4,096-token pool; a request asks 100,000 tokens, then a
  short one arrives: the step the short one is admitted at.
- livelock: random runs with prompts that continue one document and pools smaller than the
  context; runs that do not finish within 2,000 steps.

`--baseline-rev REV` also runs the same scenarios on the scheduler of git revision REV
(`git archive` into a temporary folder, run in a subprocess; config fields it does not know
are dropped) and prints both; `--json` writes the results.

    python benchmarks/sched/bench_sched_fidelity.py [--only NAME,...] [--baseline-rev REV] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import subprocess
import sys
import tempfile

from minisched.sched.sampling_params import SamplingParams
from minisched.sched.scheduler import Scheduler, SchedulerConfig

# The repository (for `git archive`); a --baseline-rev child imports the archived scheduler through PYTHONPATH.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FIELDS = {f.name for f in dataclasses.fields(SchedulerConfig)}


def make(**kw) -> Scheduler:
    return Scheduler(SchedulerConfig(**{k: v for k, v in kw.items() if k in FIELDS}))


class Driver:
    """Steps a scheduler with a constant-token fake runner and records, per request, the step
    of arrival and of every token."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched, self.step = sched, 0
        self.arrive: dict[str, int] = {}
        self.token_steps: dict[str, list[int]] = {}
        self.reqs: dict[str, object] = {}
        self.eos_at: dict[str, int] = {}
        self.max_batch_tokens = 0
        self.cum_tokens = [0]  # tokens computed up to the end of each step (a machine-free clock)

    def add(self, rid: str, prompt: list[int], max_new: int, eos_at: int | None = None) -> None:
        """`eos_at`: the request's n-th token is the stop token 2 (an answer shorter than max_new)."""
        sp = SamplingParams(max_new_tokens=max_new, ignore_eos=eos_at is None, stop_token_ids=(2,))
        self.reqs[rid] = self.sched.add_request(rid, prompt, sp)
        self.eos_at[rid] = eos_at or 1 << 60
        self.arrive[rid] = self.step
        self.token_steps[rid] = []

    def run_step(self) -> None:
        self.step += 1
        s = self.sched
        before = {rid: len(r.output_ids) for rid, r in self.reqs.items()}
        batch = s.get_next_batch()
        if batch is None:
            self.cum_tokens.append(self.cum_tokens[-1])
            (s.take_finished if hasattr(s, "take_finished") else (lambda: None))()
            return
        self.cum_tokens.append(self.cum_tokens[-1] + batch.num_tokens)
        self.max_batch_tokens = max(self.max_batch_tokens, batch.num_tokens)
        s.process_batch_result(batch, [2 if len(r.output_ids) + 1 >= self.eos_at[r.rid] else 1 for r in batch.reqs])
        for rid, r in self.reqs.items():
            if len(r.output_ids) > before[rid]:
                self.token_steps[rid].append(self.step)

    def drain(self, max_steps: int = 100_000) -> bool:
        for _ in range(max_steps):
            if not self.sched.has_work():
                return True
            self.run_step()
        return False

    def gaps(self, rids=None, tokens: bool = False) -> list[int]:
        """Steps (or tokens computed) between consecutive tokens of each request."""
        c = self.cum_tokens
        return [
            (c[b] - c[a]) if tokens else (b - a)
            for rid in (rids or self.token_steps)
            for a, b in zip(self.token_steps[rid], self.token_steps[rid][1:])
        ]

    def ttfts(self) -> list[int]:
        return [t[0] - self.arrive[rid] for rid, t in self.token_steps.items() if t]


def pct(xs: list[int], q: float) -> int:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0


def prefill_tokens(sched: Scheduler) -> int:
    return sum(s.num_prefill_tokens for s in sched.records().step_stats)


# -- scenarios --------------------------------------------------------------------------------------
def deferral_64(**kw) -> dict:
    d = Driver(make(page_size=16, num_pages=8192, chunk_size=8192, max_prefill_tokens=16384, **kw))
    rng = random.Random(0)
    system = [rng.randrange(1, 32000) for _ in range(512)]
    for i in range(64):
        d.add(f"r{i}", system + [rng.randrange(1, 32000) for _ in range(64)], 4)
    d.drain()
    return {"prefill_tokens": prefill_tokens(d.sched), "steps": d.step, "ttft_p99_steps": pct(d.ttfts(), 0.99)}


def deferral_16(**kw) -> dict:
    d = Driver(make(page_size=16, num_pages=8192, chunk_size=None, max_prefill_tokens=32768, **kw))
    rng = random.Random(1)
    system = [rng.randrange(1, 32000) for _ in range(1024)]
    for i in range(16):
        d.add(f"r{i}", system + [rng.randrange(1, 32000) for _ in range(32)], 4)
    d.drain()
    return {"prefill_tokens": prefill_tokens(d.sched), "steps": d.step, "ttft_p99_steps": pct(d.ttfts(), 0.99)}


def arrivals(**kw) -> dict:
    d = Driver(make(page_size=16, num_pages=16384, **kw))
    rng = random.Random(2)
    for i in range(8):
        d.add(f"long{i}", [rng.randrange(1, 32000) for _ in range(64)], 400)
    for i in range(200):
        d.add(f"a{i}", [rng.randrange(1, 32000) for _ in range(256)], 16)
        d.run_step()
    done = d.drain()
    g, t, gt = d.gaps(), d.ttfts(), d.gaps(tokens=True)
    return {
        "tpot_p50_steps": pct(g, 0.5),
        "tpot_p99_steps": pct(g, 0.99),
        "tpot_max_steps": max(g),
        "tpot_p99_tokens": pct(gt, 0.99),
        "ttft_p50_steps": pct(t, 0.5),
        "ttft_p99_steps": pct(t, 0.99),
        "steps": d.step,
        "finished": done,
    }


def long_prompt(**kw) -> dict:
    d = Driver(make(page_size=16, num_pages=16384, max_context_len=16384, **kw))
    rng = random.Random(3)
    for i in range(8):
        d.add(f"d{i}", [rng.randrange(1, 32000) for _ in range(32)], 100)
    for _ in range(3):
        d.run_step()
    d.add("long", [rng.randrange(1, 32000) for _ in range(8000)], 8)
    d.drain()
    dec = [f"d{i}" for i in range(8)]
    first = d.token_steps["long"][0]
    return {
        "decode_gap_max_steps": max(d.gaps(dec)),
        "decode_gap_max_tokens": max(d.gaps(dec, tokens=True)),
        "long_ttft_steps": first - d.arrive["long"],
        "long_ttft_tokens": d.cum_tokens[first] - d.cum_tokens[d.arrive["long"]],
        "steps": d.step,
    }


def mixed_budget(**kw) -> dict:
    kw = {"enable_mixed_chunk": True, "chunk_size": 512, **kw}
    d = Driver(make(page_size=16, num_pages=16384, max_context_len=8192, **kw))
    rng = random.Random(4)
    for i in range(64):
        d.add(f"d{i}", [rng.randrange(1, 32000) for _ in range(16)], 200)
    d.run_step()
    d.add("long", [rng.randrange(1, 32000) for _ in range(4000)], 8)
    d.drain()
    return {"max_batch_tokens": d.max_batch_tokens, "chunk_size": kw["chunk_size"], "steps": d.step}


def retraction(eos: bool = True, **kw) -> dict:
    d = Driver(make(page_size=16, num_pages=256 if eos else 512, max_context_len=2048, chunk_size=512, **kw))
    rng = random.Random(5)
    for i in range(256):
        prompt = [rng.randrange(3, 32000) for _ in range(rng.randint(64, 256))]
        if eos:  # answers end well before max_new_tokens, as most do
            d.add(f"r{i}", prompt, 1024, eos_at=min(1024, int(rng.expovariate(1 / 300)) + 1))
        else:  # every request runs to its max_new_tokens (ignore_eos)
            d.add(f"r{i}", prompt, rng.randint(256, 1024))
    done = d.drain()
    unique = sum(len(r.prompt_ids) for r in d.reqs.values())
    st = d.sched.records().step_stats
    decode_steps = sum(1 for s in st if s.num_decode_tokens)
    return {
        "retractions": sum(s.num_retracted for s in st),
        "recomputed_tokens": prefill_tokens(d.sched) - unique,
        "steps": d.step,
        "mean_decode_batch": round(sum(s.num_decode_tokens for s in st) / max(1, decode_steps), 1),
        "finished": done,
    }


def retraction_full(**kw) -> dict:
    return retraction(eos=False, **kw)


def huge_max_new(**kw) -> dict:
    d = Driver(make(page_size=16, num_pages=256, max_context_len=512, **kw))
    d.add("big", list(range(1, 17)), 100_000)
    d.run_step()
    d.add("short", [5, 6, 7], 4)
    for _ in range(2000):
        if d.token_steps["short"] or not d.sched.has_work():
            break
        d.run_step()
    return {"short_first_token_step": d.token_steps["short"][0] if d.token_steps["short"] else None}


def livelock(n_runs: int = 600, **kw) -> dict:
    rng = random.Random(6)
    doc = [rng.randrange(1, 50) for _ in range(200)]
    hung = 0
    for _ in range(n_runs):
        ps = rng.choice([1, 2, 4])
        pool = rng.randint(12, 64)
        try:
            sched = make(
                page_size=ps,
                num_pages=max(1, pool // ps),
                chunk_size=rng.choice([None, 4, 8, 16]),
                max_context_len=rng.choice([48, 96, 1000]),
                init_new_token_ratio=rng.choice([0.7, 0.1]),
                min_new_token_ratio=0.05,
                new_token_ratio_decay_steps=10,
                **kw,
            )
        except ValueError:
            continue
        d = Driver(sched)
        for j in range(rng.randint(2, 6)):
            n = rng.randint(1, pool)
            try:
                d.add(f"r{j}", doc[:n], rng.choice([1, 2, 8, 64, 100_000]))
            except ValueError:  # InvalidRequest: too long for this pool or context
                pass
            for _ in range(rng.randint(0, 3)):
                d.run_step()
        hung += not d.drain(2000)
    return {"runs": n_runs, "hung": hung}


SCENARIOS = {
    "deferral-64": deferral_64,
    "deferral-16": deferral_16,
    "arrivals": arrivals,
    "long-prompt": long_prompt,
    "mixed-budget": mixed_budget,
    "retraction": retraction,
    "retraction-full": retraction_full,
    "huge-max-new": huge_max_new,
    "livelock": livelock,
}
# (label, scenario, config overrides): the rows of the table
VARIANTS = [
    ("default", None, {}),
    ("no deferral", ("deferral-64", "deferral-16"), {"in_batch_prefix_defer_tokens": None}),
    (  # (the default is prefill first: bench_rules.py, RESULTS.md "Rules: minisched's vs SGLang's")
        "alternating (guard 1)",
        ("arrivals", "long-prompt", "retraction", "retraction-full"),
        {"max_prefill_rounds_between_decodes": 1},
    ),
    ("guard 2", ("arrivals", "long-prompt"), {"max_prefill_rounds_between_decodes": 2}),
    ("guard 4", ("arrivals", "long-prompt"), {"max_prefill_rounds_between_decodes": 4}),
    ("mixed chunk", ("arrivals", "long-prompt"), {"enable_mixed_chunk": True}),
]


def run_all(only: set[str] | None, baseline: bool) -> list[dict]:
    rows = []
    for label, names, kw in VARIANTS[:1] if baseline else VARIANTS:
        for name, fn in SCENARIOS.items():
            if (names is not None and name not in names) or (only and name not in only):
                continue
            if names is not None and any(k not in FIELDS for k in kw):
                continue  # the baseline has no such knob
            rows.append({"scenario": name, "variant": label, **fn(**kw)})
    return rows


def baseline(rev: str, only: set[str] | None) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        arch = subprocess.run(
            ["git", "-C", ROOT, "archive", rev, "minisched/__init__.py", "minisched/sched"],
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=arch, check=True)
        env = {**os.environ, "PYTHONPATH": tmp, "FIDELITY_BASELINE": rev}
        args = [sys.executable, os.path.abspath(__file__), "--json", os.path.join(tmp, "out.json")]
        if only:
            args += ["--only", ",".join(sorted(only))]
        subprocess.run(args, check=True, env=env, cwd=tmp, stdout=subprocess.DEVNULL)
        with open(os.path.join(tmp, "out.json")) as f:
            return json.load(f)["rows"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "bench_sched_fidelity.json"))
    ap.add_argument("--baseline-rev", default=None, help="git revision whose scheduler is the 'before' row")
    ap.add_argument("--only", default="", help="comma-separated scenario names")
    args = ap.parse_args()
    only = set(filter(None, args.only.split(",")))
    base_rev = os.environ.get("FIDELITY_BASELINE")
    rows = run_all(only, bool(base_rev))
    if base_rev:
        for r in rows:
            r["variant"] = f"before ({base_rev})"
    if args.baseline_rev:
        rows = baseline(args.baseline_rev, only) + rows
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"rows": rows}, f, indent=2)
    for name in SCENARIOS:
        for r in rows:
            if r["scenario"] == name:
                metrics = ", ".join(f"{k} {v}" for k, v in r.items() if k not in ("scenario", "variant"))
                print(f"{name:<13} {r['variant']:<28} {metrics}")


if __name__ == "__main__":
    main()
