"""Serving-benchmark workloads and the two ways to run them: continuous batching and a static baseline.

Workloads (`make_workload`), all token-id prompts drawn from ordinary vocabulary ids with a
fixed seed, outputs forced to their length (`ignore_eos`):

  mixed          prompts 16-512 tokens, outputs 16-256, Poisson arrivals at `rate` req/s
  shared-prefix  groups of requests sharing a long system prefix (4 prefixes of ~400 tokens)
                 + a short question; outputs 16-64; Poisson arrivals
  long-prompt    prompts 1-3k tokens, outputs 8-32 (chunked prefill at work); Poisson arrivals
  poisson        uniform chat-sized requests (prompt 64-128, output 64) with Poisson arrivals

and multi-turn chats (`make_conversations`): each turn's prompt is the conversation so far, so
it depends on the replies; a client runs them closed loop (observe/http_bench.py).

`rate <= 0` (or inf) means every request arrives at t=0.

`run_workload(engine, workload, mode)`:
  continuous  requests enter the scheduler when they arrive; finished ones leave between steps
  static      the baseline: when the engine is idle, the requests that have arrived (up to
              `static_batch`) form a batch that runs until all of them finish; nothing joins it

Both step the `Engine` (`Engine.step`: overlap scheduling, grammars and host-tier loads as when
serving). Latencies are measured from each request's scheduled arrival (queueing included:
`Engine.add_request(arrival_time=)` dates the request and its arrival event back).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from minisched.sched.req import Req
from minisched.sched.sampling_params import SamplingParams

WORKLOADS = ("mixed", "shared-prefix", "long-prompt", "poisson")
TOKEN_RANGE = (1000, 20000)  # ordinary BPE tokens in SmolLM2's (and most) vocabularies


@dataclass(frozen=True)
class BenchRequest:
    rid: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    arrival: float  # seconds after the start


def _tokens(rng, n: int, vocab: int) -> tuple[int, ...]:
    lo, hi = TOKEN_RANGE if vocab > TOKEN_RANGE[1] else (3, vocab)
    return tuple(int(t) for t in rng.integers(lo, hi, size=n))


def _arrivals(rng, n: int, rate: float) -> np.ndarray:
    if rate <= 0 or math.isinf(rate):
        return np.zeros(n)
    return np.cumsum(rng.exponential(1.0 / rate, size=n)) - 0.0


def make_workload(
    name: str, num_requests: int, rate: float, *, vocab: int = 49152, seed: int = 0, scale: float = 1.0
) -> list[BenchRequest]:
    """`scale` < 1 shrinks prompt and output lengths (for quick runs and tests)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; expected one of {WORKLOADS}")
    if num_requests < 1:
        raise ValueError("num_requests must be >= 1")
    rng = np.random.default_rng(seed)
    s = lambda x: max(1, int(round(x * scale)))  # noqa: E731
    arrivals = _arrivals(rng, num_requests, rate)
    reqs = []
    prefixes = [_tokens(rng, s(rng.integers(350, 450)), vocab) for _ in range(4)]
    for i in range(num_requests):
        if name == "mixed":
            prompt, out = _tokens(rng, s(rng.integers(16, 513)), vocab), s(rng.integers(16, 257))
        elif name == "shared-prefix":
            prompt = prefixes[i % len(prefixes)] + _tokens(rng, s(rng.integers(8, 33)), vocab)
            out = s(rng.integers(16, 65))
        elif name == "long-prompt":
            prompt, out = _tokens(rng, s(rng.integers(1000, 3001)), vocab), s(rng.integers(8, 33))
        else:
            prompt, out = _tokens(rng, s(rng.integers(64, 129)), vocab), s(64)
        reqs.append(BenchRequest(f"{name}-{i}", prompt, out, float(arrivals[i])))
    return reqs


def make_shared_prefix(
    num_requests: int,
    prefixes: int,
    rate: float,
    *,
    vocab: int = 49152,
    seed: int = 0,
    scale: float = 1.0,
    name: str = "shared-prefix",
) -> list[BenchRequest]:
    """shared-prefix's shape with `prefixes` groups and each request's group drawn at random (with
    `make_workload`'s `i % 4` order, round-robin over 2 servers keeps every prefix on one by accident)."""
    if num_requests < 1 or prefixes < 1:
        raise ValueError("num_requests and prefixes must be >= 1")
    rng = np.random.default_rng(seed)
    s = lambda x: max(1, int(round(x * scale)))  # noqa: E731
    toks = lambda k: _tokens(rng, k, vocab)  # noqa: E731
    heads = [toks(s(rng.integers(350, 451))) for _ in range(prefixes)]
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=num_requests)) if rate > 0 else np.zeros(num_requests)
    return [
        BenchRequest(
            f"{name}-{seed}-{i}",
            heads[int(rng.integers(prefixes))] + toks(s(rng.integers(8, 33))),
            s(rng.integers(16, 65)),
            float(arrivals[i]),
        )
        for i in range(num_requests)
    ]


@dataclass(frozen=True)
class Conversation:
    """A multi-turn chat: per turn, the user's new tokens and the reply's length. The prompt of turn t
    is everything before it (earlier turns and their replies) + its own tokens: a client builds it."""

    cid: str
    turns: tuple[tuple[tuple[int, ...], int], ...]
    start: float = 0.0  # seconds after the start of the run


def make_conversations(
    num_conversations: int, turns: int, *, vocab: int = 49152, seed: int = 0, scale: float = 1.0
) -> list[Conversation]:
    """multi-turn: each conversation opens with its own system prompt of 150-250 tokens; every turn
    adds a 16-48-token user message and asks for a 16-48-token reply (x `scale`)."""
    if num_conversations < 1 or turns < 1:
        raise ValueError("num_conversations and turns must be >= 1")
    rng = np.random.default_rng(seed)
    s = lambda x: max(1, int(round(x * scale)))  # noqa: E731
    convs = []
    for c in range(num_conversations):
        system = _tokens(rng, s(rng.integers(150, 251)), vocab)
        msgs = [_tokens(rng, s(rng.integers(16, 49)), vocab) for _ in range(turns)]
        convs.append(
            Conversation(
                f"conv-{seed}-{c}",
                tuple(((system if t == 0 else ()) + m, s(rng.integers(16, 49))) for t, m in enumerate(msgs)),
            )
        )
    return convs


@dataclass(kw_only=True)
class RequestResult:
    rid: str
    prompt_tokens: int
    output_tokens: int
    arrival: float
    first_token: Optional[float]  # seconds after the start
    finish: Optional[float]
    cached_tokens: int = 0
    num_retractions: int = 0
    output_ids: list[int] = field(default_factory=list, repr=False)

    @property
    def ttft(self) -> Optional[float]:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> Optional[float]:
        return None if self.finish is None else self.finish - self.arrival

    @property
    def tpot(self) -> Optional[float]:
        if self.finish is None or self.first_token is None or self.output_tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.output_tokens - 1)


@dataclass(kw_only=True)
class RunResult:
    name: str
    requests: list[RequestResult]
    duration: float
    start: float  # time.monotonic() at the start
    step_time: float  # seconds inside engine steps (engine.step)
    retractions: int
    scheduler_time: float  # of those, the seconds outside the runner's forward and sampling
    interrupted: bool = False  # Ctrl-C ended the run early: unfinished requests were aborted

    def summary(self) -> dict:
        return summarize(self)


def percentiles(values: list[float]) -> dict:
    """Mean and p50/p90/p99 with the one percentile definition the report uses too
    (linear interpolation between order statistics)."""
    from minisched.observe.run_record import percentile

    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    return {"mean": sum(values) / len(values), **{f"p{q}": percentile(values, q) for q in (50, 90, 99)}}


def summarize(run: RunResult) -> dict:
    done = [r for r in run.requests if r.finish is not None]
    inp = sum(r.prompt_tokens for r in done)
    out = sum(r.output_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    d = max(run.duration, 1e-9)
    return {
        "name": run.name,
        "num_requests": len(run.requests),
        "completed": len(done),
        "duration_s": run.duration,
        "input_tokens": inp,
        "output_tokens": out,
        "input_tok_s": inp / d,
        "output_tok_s": out / d,
        "total_tok_s": (inp + out) / d,
        "request_throughput": len(done) / d,
        "ttft_s": percentiles([r.ttft for r in done if r.ttft is not None]),
        "tpot_s": percentiles([r.tpot for r in done if r.tpot is not None]),
        "e2e_latency_s": percentiles([r.e2e for r in done if r.e2e is not None]),  # all of them: done
        "cache_hit_rate": cached / inp if inp else 0.0,
        "cached_tokens": cached,
        "retractions": run.retractions,
        "scheduler_overhead_share": run.scheduler_time / d,
        "forward_share": max(0.0, run.step_time - run.scheduler_time) / d,
    }


def run_workload(
    engine,
    workload: list[BenchRequest],
    mode: str = "continuous",
    *,
    static_batch: int = 8,
    progress: Optional[Callable[[dict], None]] = None,
    name: Optional[str] = None,
) -> RunResult:
    """Replay a workload against `engine` in real time (see the module docstring for the modes)."""
    if mode not in ("continuous", "static"):
        raise ValueError(f"mode must be 'continuous' or 'static', got {mode!r}")
    pending = sorted(workload, key=lambda r: r.arrival)
    queue: list[BenchRequest] = []
    reqs: dict[str, Req] = {}
    results: dict[str, Req] = {}
    retract0, forward0 = engine.scheduler.snapshot().retractions, engine.runner.forward_time
    start = time.monotonic()

    def admit(items):
        for br in items:
            sp = SamplingParams(max_new_tokens=br.max_new_tokens, ignore_eos=True)
            # Latencies count from the scheduled arrival: a request due while a step ran waited for it,
            # and its arrival event (the report's Gantt bar) says so as well.
            reqs[br.rid] = engine.add_request(list(br.prompt_ids), sp, rid=br.rid, arrival_time=start + br.arrival)

    interrupted, step_times = False, list[float]()
    try:
        _replay(engine, pending, queue, mode, static_batch, admit, results, start, progress, len(workload), step_times)
    except KeyboardInterrupt:  # Ctrl-C: keep what finished, abort the rest (their pages come back)
        interrupted = True
        for rid in list(reqs):
            if rid not in results:
                engine.abort(rid)
    step_time = sum(step_times)
    duration = time.monotonic() - start
    out = []
    for br in workload:
        req = results.get(br.rid)
        rel = lambda t: None if t is None else t - start  # noqa: E731
        out.append(
            RequestResult(
                rid=br.rid,
                prompt_tokens=len(br.prompt_ids),
                output_tokens=len(req.output_ids) if req else 0,
                arrival=br.arrival,
                first_token=rel(req.first_token_time) if req else None,
                finish=rel(req.finish_time) if req else None,
                cached_tokens=req.cache_hit_tokens if req else 0,
                num_retractions=req.num_retractions if req else 0,
                output_ids=list(req.output_ids) if req else [],
            )
        )
    return RunResult(
        name=name or mode,
        requests=out,
        duration=duration,
        start=start,
        step_time=step_time,
        retractions=engine.scheduler.snapshot().retractions - retract0,
        scheduler_time=step_time - (engine.runner.forward_time - forward0),
        interrupted=interrupted,
    )


def _replay(
    engine, pending, queue, mode, static_batch, admit, results, start, progress, total, step_times: list
) -> None:
    while pending or queue or engine.has_work():
        now = time.monotonic() - start
        while pending and pending[0].arrival <= now:
            queue.append(pending.pop(0))
        if mode == "continuous" and queue:
            admit(queue)
            queue = []
        elif mode == "static" and queue and not engine.has_work():
            admit(queue[:static_batch])
            queue = queue[static_batch:]
        if not engine.has_work():
            if pending:
                time.sleep(max(0.0, min(pending[0].arrival - (time.monotonic() - start), 0.05)))
            continue
        t = time.monotonic()
        for req in engine.step():
            results[req.rid] = req
        step_times.append(time.monotonic() - t)
        if progress is not None:
            snap = engine.scheduler.snapshot()
            progress(
                {
                    "elapsed": time.monotonic() - start,
                    "done": len(results),
                    "total": total,
                    "running": snap.running,
                    "waiting": snap.waiting + len(queue) + len(pending),
                }
            )


def run_record(engine, result: RunResult, config: Optional[dict] = None):
    """The run as a `minisched.observe.run_record.RunRecord` (events, step stats, per-request metrics)
    for `minisched report` and the Chrome trace; the bench summary is attached."""
    from minisched.observe.run_record import RunRecord

    summary = summarize(result)
    return RunRecord.from_scheduler(
        result.name, engine.scheduler, config=config, summary=summary, start_time=result.start
    )


def workload_stats(workload: list[BenchRequest]) -> dict:
    p = [len(r.prompt_ids) for r in workload]
    o = [r.max_new_tokens for r in workload]
    return {
        "num_requests": len(workload),
        "prompt_tokens": sum(p),
        "output_tokens": sum(o),
        "prompt_len": [min(p), max(p)],
        "output_len": [min(o), max(o)],
        "last_arrival_s": max(r.arrival for r in workload),
    }


def asdict(x) -> dict:
    return dataclasses.asdict(x)
