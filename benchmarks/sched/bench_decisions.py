"""What recording decisions costs (minisched/sched/decisions.py + journal.py), against the steps it records.

1. The scheduler alone (a runner that computes nothing): a B=64 decode step and a 512-token prefill step,
   timed with the journal and the decision records as they are ("on") and with both stubbed out ("off"),
   interleaved blocks, median per step. The difference is the recording's cost.
2. The real model's steps (SmolLM2 on this machine, the default engine): the same two steps' forward
   times, so the cost is stated as a share of the step it rides on. Target: <= 2 % of each.
3. Memory: journal bytes per step (JSON), and what a server keeps (it drains every few hundred steps).

    python benchmarks/sched/bench_decisions.py [--blocks 6] [--json PATH] [--no-model]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from contextlib import contextmanager

from minisched.sched import batch_builder, journal
from minisched.sched.decisions import StepWhy
from minisched.sched.sampling_params import SamplingParams
from minisched.sched.scheduler import Scheduler, SchedulerConfig


@contextmanager
def recording_off():
    """Stub every recording call (the journal's entries and the step's decisions)."""
    saved = {}
    targets = [
        (journal.Journal, "append"),
        (journal.Journal, "add"),
        (journal.Journal, "build"),
        (journal.Journal, "resolve"),
        (StepWhy, "skip"),
        (StepWhy, "stop"),
        (StepWhy, "admit"),
        (StepWhy, "retract"),
        (batch_builder, "note_waiting"),
    ]
    for obj, name in targets:
        saved[(obj, name)] = getattr(obj, name)
        setattr(obj, name, (lambda *a, **k: {}) if name == "resolve" else (lambda *a, **k: None))
    try:
        yield
    finally:
        for (obj, name), fn in saved.items():
            setattr(obj, name, fn)


class NullRunner:
    def forward(self, batch):
        return [7] * len(batch.reqs)


def decode_steps(n_steps: int) -> float:
    """Median scheduler seconds per B=64 decode step."""
    cfg = SchedulerConfig(page_size=16, num_pages=8192, max_context_len=4096, max_running_requests=64)
    sched = Scheduler(cfg)
    for i in range(64):
        sched.add_request(f"r{i}", [(i * 31 + j) % 30000 for j in range(128)], SamplingParams(max_new_tokens=10_000))
    runner = NullRunner()
    while sched.snapshot().running < 64:
        sched.step(runner)
    times = []
    for _ in range(n_steps):
        t = time.perf_counter()
        sched.step(runner)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def prefill_steps(n_steps: int) -> float:
    """Median scheduler seconds per 512-token prefill step (a fresh request each step, no cache hit)."""
    cfg = SchedulerConfig(page_size=16, num_pages=65536, max_context_len=4096, chunk_size=512)
    sched = Scheduler(cfg)
    runner = NullRunner()
    times = []
    for i in range(n_steps):
        sched.add_request(f"p{i}", [(i * 997 + j) % 30000 + 1 for j in range(512)], SamplingParams(max_new_tokens=1))
        t = time.perf_counter()
        sched.step(runner)
        times.append(time.perf_counter() - t)
        sched.flush_cache()
    return statistics.median(times)


def journal_bytes_per_step() -> float:
    cfg = SchedulerConfig(page_size=16, num_pages=8192, max_context_len=4096, max_running_requests=64)
    sched = Scheduler(cfg)
    for i in range(64):
        sched.add_request(f"r{i}", [(i * 31 + j) % 30000 for j in range(128)], SamplingParams(max_new_tokens=64))
    runner = NullRunner()
    while sched.has_work():
        sched.step(runner)
    rec = sched.records()
    return len(json.dumps(list(rec.journal))) / max(sched.step_count, 1)


def model_steps() -> dict:
    """The real forward times of a 512-token prefill and a B=64 decode step (SmolLM2, default engine)."""
    from minisched.engine import Engine
    from minisched.engine.config import EngineConfig

    engine = Engine(config=EngineConfig())
    prompt = [(j * 13) % 40000 + 10 for j in range(512)]
    engine.generate([prompt], SamplingParams(max_new_tokens=1, ignore_eos=True))
    engine.step_times.clear()
    engine.generate([[(j * 17) % 40000 + 10 for j in range(512)]], SamplingParams(max_new_tokens=1, ignore_eos=True))
    prefill = min(b - a for a, b in engine.step_times)
    prompts = [[(i * 7 + j) % 40000 + 10 for j in range(16)] for i in range(64)]
    engine.step_times.clear()
    engine.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    decode = statistics.median(b - a for a, b in engine.step_times[-8:])
    # the weights' format as resolved (the default, auto: gguf for SmolLM2)
    return {"prefill_512_s": prefill, "decode_b64_s": decode, "quantize": engine.quant.mode}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-model", action="store_true", help="skip the real model's step times")
    args = ap.parse_args()
    res: dict = {"decode_on": [], "decode_off": [], "prefill_on": [], "prefill_off": []}
    for _ in range(args.blocks):  # interleaved: on, off, on, off ...
        res["decode_on"].append(decode_steps(args.steps))
        res["prefill_on"].append(prefill_steps(args.steps))
        with recording_off():
            res["decode_off"].append(decode_steps(args.steps))
            res["prefill_off"].append(prefill_steps(args.steps))
    out = {k: statistics.median(v) for k, v in res.items()}
    out["decode_cost_s"] = out["decode_on"] - out["decode_off"]
    out["prefill_cost_s"] = out["prefill_on"] - out["prefill_off"]
    out["journal_bytes_per_step_b64"] = journal_bytes_per_step()
    out["load"] = os.getloadavg()
    out["machine"] = platform.processor() or platform.machine()
    if not args.no_model:
        out.update(model_steps())
        out["decode_cost_share"] = out["decode_cost_s"] / out["decode_b64_s"]
        out["prefill_cost_share"] = out["prefill_cost_s"] / out["prefill_512_s"]
        # a bound that noise cannot hide: the whole scheduler step, recording included, against the model step
        out["decode_bound_share"] = out["decode_on"] / out["decode_b64_s"]
        out["prefill_bound_share"] = out["prefill_on"] / out["prefill_512_s"]
    if "quantize" in out:
        print(f"model steps: SmolLM2, quantize {out['quantize']}")
    print(
        "| step | scheduler, recording on | off | recording cost | model step | share | bound: whole scheduler step |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, key, model_key in (
        ("B=64 decode", "decode", "decode_b64_s"),
        ("512-token prefill", "prefill", "prefill_512_s"),
    ):
        m = out.get(model_key)
        share = f"{out[f'{key}_cost_s'] / m:.3%}" if m else "-"
        bound = f"{out[f'{key}_on'] / m:.3%}" if m else "-"
        print(
            f"| {name} | {out[f'{key}_on'] * 1e6:.0f} us | {out[f'{key}_off'] * 1e6:.0f} us | "
            f"{out[f'{key}_cost_s'] * 1e6:.0f} us | {'-' if m is None else f'{m * 1e3:.1f} ms'} | {share} | {bound} |"
        )
    print(f"journal: {out['journal_bytes_per_step_b64']:.0f} bytes per B=64 step (JSON); load {out['load']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
