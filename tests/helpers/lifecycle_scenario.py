"""A small recorded run for the trace/report tests and the docs example (no torch).

`record_scenario()` runs the real Scheduler with the deterministic fake runner on a tiny
KV pool: a shared system prompt (prefix hits), prompts longer than the chunk (chunked
prefill), more decode growth than the pool holds (retractions), one request aborted
while running and one while waiting. The runner sleeps a little per step so the times
look like a real run.

`PYTHONPATH=tests python -m helpers.lifecycle_scenario` rewrites docs/example_run.json and docs/lifecycle.png.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from helpers.fake_runner import FakeRunner, check_lifecycles
from minisched.observe.run_record import RunRecord
from minisched.sched.sampling_params import SamplingParams
from minisched.sched.scheduler import Scheduler, SchedulerConfig

VOCAB = 50
SYSTEM = list(range(100, 112))  # 12-token shared prefix: 3 pages of 4


class TimedRunner(FakeRunner):
    """FakeRunner that takes `base + per_token * tokens` seconds per forward."""

    def __init__(self, num_pages: int, page_size: int, base: float, per_token: float) -> None:
        super().__init__(num_pages, page_size, VOCAB)
        self.base, self.per_token = base, per_token

    def forward(self, batch):
        if self.base or self.per_token:
            time.sleep(self.base + self.per_token * batch.num_tokens)
        return super().forward(batch)


def scenario_config(**overrides) -> SchedulerConfig:
    kw = dict(
        page_size=4,
        num_pages=20,
        chunk_size=8,
        max_prefill_tokens=16,
        max_context_len=256,
        init_new_token_ratio=0.1,
        min_new_token_ratio=0.05,
    )
    kw.update(overrides)
    return SchedulerConfig(**kw)


# (step at which it arrives, rid, prompt, max_new_tokens)
ARRIVALS = [
    (0, "r0", SYSTEM + [1, 2, 3], 16),
    (0, "r1", list(range(200, 222)), 12),
    (2, "r2", SYSTEM + [4, 5], 14),
    (3, "r3", list(range(300, 306)), 20),
    (4, "r4", list(range(400, 405)), 30),
    (5, "r5", SYSTEM + [6, 7, 8, 9], 10),
    (6, "r6", list(range(500, 530)), 8),
    (9, "r7", SYSTEM + [9], 12),
]
ABORTS = {8: "r4", 10: "r7"}  # step -> rid: r4 while running, r7 while waiting


def record_scenario(
    name: str = "scenario", base: float = 0.0005, per_token: float = 0.00005, **overrides
) -> tuple[RunRecord, Scheduler]:
    cfg = scenario_config(**overrides)
    sched = Scheduler(cfg)
    runner = TimedRunner(cfg.num_pages, cfg.page_size, base, per_token)
    start = time.monotonic()
    for i in range(500):
        for at, rid, prompt, max_new in ARRIVALS:
            if at == i:
                sched.add_request(rid, prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True))
        if i in ABORTS:
            sched.abort(ABORTS[i])
        if not sched.has_work() and i > max(at for at, *_ in ARRIVALS):
            break
        sched.step(runner)
        sched.check_invariants()
    check_lifecycles(sched.records().events)
    config = {"workload": "tests/helpers/lifecycle_scenario.py", "runner": "fake (sleeps per step)"}
    summary = {"note": "deterministic fake runner; not a model"}
    return RunRecord.from_scheduler(name, sched, config, summary, start_time=start), sched


def write_docs(docs: Path) -> None:
    from minisched.observe.report import render_report
    from minisched.observe.run_record import save_runs

    rec, _ = record_scenario("tiny pool (20 pages of 4 tokens)", base=0.004, per_token=0.0002)
    save_runs(docs / "example_run.json", [rec])
    render_report([rec], docs / "lifecycle.png")


if __name__ == "__main__":
    write_docs(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / "docs")
