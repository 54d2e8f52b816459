"""What-if: the traffic of a recorded run under other scheduler settings, predicted.

1. The run's own traffic: an exact replay (sched/replay.py) of its journal gives every request's
   prompt, sampling fields, arrival time, n > 1 leader, grammar wait, abort time and the tokens it
   produced (their ids: a multi-turn prompt that repeats an answer hits the radix cache the same way).
2. A step-cost model fitted on the run's own steps (`CostModel.fit`): seconds per step =
   c0 + c1 * prefill tokens + c2 * prefill attention (new tokens x context, thousands) + c3 * decode
   rows + c4 * decode context tokens (thousands) + c5 * draft tokens, non-negative least squares. A
   step's measured cost is from its build to the next build (the engine's whole cycle), or to its
   resolve when the scheduler was idle after it (then the gap was waiting for traffic).
3. A simulation: a fresh Scheduler with the settings changed, driven on a virtual clock -- arrivals,
   aborts and grammar waits at their recorded times, each step advancing the clock by the model's cost
   of its batch, each request producing its recorded tokens and ending where it ended (a stop string
   or an error at the same length; a request that would now produce more than it did repeats its last
   token). Speculative decoding is not simulated (plain decode steps), nor host-tier copy time.

`predict(run, overrides)` returns the predicted TTFT p50 / p99, output throughput and cache hit rate
beside the recorded ones, the model's fit (R^2, mean step error) and its error on the recorded
settings themselves (the same simulation with nothing changed: the model's own bias on this run).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from minisched.observe.run_record import RunRecord, percentile
from minisched.sched.batch import Batch
from minisched.sched.host_tier import HostTier
from minisched.sched.replay import JournalError, JournalGate, NullMover, config_of, replay
from minisched.sched.req import FinishReason, Req
from minisched.sched.sampling_params import SamplingParams
from minisched.sched.scheduler import Scheduler

FEATURES = ("step", "prefill_tokens", "prefill_attn_k", "decode_rows", "decode_ctx_k", "draft_tokens")


@dataclass(frozen=True, kw_only=True)
class Traffic:
    rid: str
    prompt: list[int]
    sampling: dict
    after: str | None
    arrival: float  # seconds, the run's clock
    opened: float | None  # when its grammar was found compiled (None: no grammar)
    abort: float | None  # when it was aborted (or failed while waiting), if it was
    output: list[int]  # the tokens it produced
    ends_by_checker: bool  # its end was a stop string or an error at len(output): the simulation ends it there


@dataclass
class CostModel:
    coef: np.ndarray
    r2: float
    mean_abs_err: float  # over the fitted steps, as a fraction of their mean cost
    num_steps: int

    @staticmethod
    def features(prefix: list[int], extend: list[int], prefill_rows: set[int], drafts: list[int]) -> np.ndarray:
        x = np.zeros(len(FEATURES))
        x[0] = 1.0
        for b, (p, e) in enumerate(zip(prefix, extend)):
            if b in prefill_rows:
                x[1] += e
                x[2] += e * (p + e / 2) / 1e3
            else:
                x[3] += 1
                x[4] += (p + e) / 1e3
                x[5] += drafts[b] if b < len(drafts) else 0
        return x

    @classmethod
    def fit(cls, journal: list[dict]) -> CostModel:
        """Each built batch's cost is the time to the next build (the engine's whole cycle: forward,
        output handling, scheduling), or to its resolve when the scheduler was left idle after it."""
        xs, ys = [], []
        builds = [i for i, e in enumerate(journal) if e.get("op") == "build"]
        for k, i in enumerate(builds):
            e = journal[i]
            if "rids" not in e:
                continue
            nxt = builds[k + 1] if k + 1 < len(builds) else len(journal)
            between = journal[i + 1 : nxt]
            idle = [x for x in between if x.get("op") == "resolve" and x.get("idle")]
            if any(x.get("op") == "fail" for x in between):
                continue
            if idle:
                end = float(idle[0].get("t", 0.0))
            elif nxt < len(journal):
                end = float(journal[nxt].get("t", 0.0))
            else:
                continue
            xs.append(_entry_features(e))
            ys.append(max(0.0, end - float(e.get("t", 0.0))))
        if len(ys) < len(FEATURES):
            raise JournalError(f"too few steps to fit a cost model ({len(ys)})")
        X, y = np.array(xs), np.array(ys)
        coef = _nnls(X, y)
        pred = X @ coef
        ss_res = float(((y - pred) ** 2).sum())
        ss_tot = float(((y - y.mean()) ** 2).sum()) or 1e-12
        return cls(
            coef=coef,
            r2=1 - ss_res / ss_tot,
            mean_abs_err=float(np.abs(y - pred).mean() / max(y.mean(), 1e-12)),
            num_steps=len(ys),
        )

    def cost(self, batch: Batch, prefill_rows: set[int]) -> float:
        drafts = [len(d) for d in batch.drafts]
        return float(self.features(batch.prefix_lens, batch.extend_lens, prefill_rows, drafts) @ self.coef)

    def describe(self) -> str:
        terms = ", ".join(f"{n} {c * 1e3:.4g} ms" for n, c in zip(FEATURES, self.coef))
        return (
            f"step cost model ({self.num_steps} steps): {terms}; R^2 {self.r2:.3f}, mean error {self.mean_abs_err:.1%}"
        )


def _entry_features(e: dict) -> np.ndarray:
    admitted = {a[0] for a in e.get("why", {}).get("admitted", ())}
    rows = {b for b, rid in enumerate(e["rids"]) if rid in admitted}
    drafts = [len(d) for d in e.get("drafts", [])]
    return CostModel.features(e["prefix"], e["extend"], rows, drafts)


def _nnls(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients: refit without the most negative one until none is."""
    active = list(range(X.shape[1]))
    coef = np.zeros(X.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(X[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef


def traffic(run: RunRecord) -> list[Traffic]:
    """The run's requests, from an exact replay of its journal (which must be identical)."""
    result = replay(run.journal)
    if not result.identical:
        d = result.divergence
        assert d is not None
        raise JournalError(f"the run's journal does not replay identically (step {d.step}): its traffic is unknown")
    adds = [e for e in run.journal if e.get("op") == "add"]
    aborts: dict[str, float] = {}
    opened: dict[str, float] = {}
    for e in run.journal:
        if e.get("op") in ("abort", "fail_waiting"):
            aborts.setdefault(e["rid"], float(e.get("t", 0.0)))
        elif e.get("op") == "build":
            for rid in e.get("opened", ()):
                opened.setdefault(rid, float(e.get("t", 0.0)))
    out = []
    for e in adds:
        req = result.requests[e["rid"]]
        by_checker = req.finish_reason in (FinishReason.STOP_STR, FinishReason.ERROR)
        out.append(
            Traffic(
                rid=e["rid"],
                prompt=list(e["prompt"]),
                sampling=dict(e["sampling"]),
                after=e.get("after"),
                arrival=float(e.get("t", 0.0)),
                opened=opened.get(e["rid"]) if e.get("gated") else None,
                abort=aborts.get(e["rid"]) if req.finish_reason is FinishReason.ABORT else None,
                output=list(req.output_ids),
                ends_by_checker=by_checker,
            )
        )
    return out


@dataclass
class Outcome:
    ttft_p50: float | None
    ttft_p99: float | None
    output_tok_s: float
    cache_hit_rate: float
    duration: float

    def row(self) -> dict:
        return dataclasses.asdict(self)


def simulate(run: RunRecord, requests: list[Traffic], model: CostModel, overrides: dict) -> Outcome:
    """The traffic on a virtual clock under the recorded config with `overrides`."""
    config = config_of(run.journal, overrides)
    init = run.journal[0]
    host = init.get("host")
    tier = None if host is None else HostTier(int(host[0]), NullMover(), write_through=bool(host[1]))
    by_rid = {t.rid: t for t in requests}

    def checker(req: Req) -> bool:
        t = by_rid.get(req.rid)
        return t is not None and t.ends_by_checker and len(req.output_ids) >= len(t.output)

    sched = Scheduler(config, stop_checker=checker, host_tier=tier)
    pending = sorted(requests, key=lambda t: t.arrival)
    gates: dict[str, tuple[JournalGate, float]] = {}
    aborts = sorted((t.abort, t.rid) for t in requests if t.abort is not None)
    live: dict[str, Req] = {}
    first_token: dict[str, float] = {}
    finish: dict[str, float] = {}
    hits: dict[str, int] = {}
    arrival: dict[str, float] = {}
    clock = pending[0].arrival if pending else 0.0
    while pending or sched.has_work():
        while pending and pending[0].arrival <= clock:
            t = pending.pop(0)
            sp = SamplingParams(**{**t.sampling, "stop_token_ids": tuple(t.sampling["stop_token_ids"])})
            gate = None
            if t.opened is not None:
                gate = JournalGate()
                gates[t.rid] = (gate, t.opened)
            after = live.get(t.after) if t.after else None
            try:
                live[t.rid] = sched.add_request(t.rid, t.prompt, sp, after=after, gate=gate)
            except ValueError:  # it does not fit the new settings (a smaller pool): refused, as a server would
                continue
            arrival[t.rid] = t.arrival
        for gate, at in gates.values():
            gate.ready = gate.ready or at <= clock
        while aborts and aborts[0][0] <= clock:
            sched.abort(aborts.pop(0)[1])
        batch = sched.get_next_batch()
        if batch is None:
            sched.take_finished()
            nxt = [x for x in ([pending[0].arrival] if pending else []) + [a for _, a in gates.values()]]
            nxt += [aborts[0][0]] if aborts else []
            later = [x for x in nxt if x > clock]
            if not later and not sched.has_work():
                break
            clock = min(later) if later else clock + 1e-3
            continue
        rows = set(range(batch.batch_size - batch.num_decode))  # prefill rows (a MIXED batch's first)
        for b in rows:
            hits.setdefault(batch.reqs[b].rid, batch.reqs[b].cache_hit_tokens)
        clock += max(0.0, model.cost(batch, rows))
        tokens = []
        for r, sampled in zip(batch.reqs, batch.sampled):
            rec = by_rid[r.rid].output if r.rid in by_rid else []
            n = len(r.output_ids)
            tokens.append(0 if not sampled else rec[n] if n < len(rec) else (rec[-1] if rec else 0))
        for r in sched.process_batch_result(batch, tokens):
            finish[r.rid] = clock
        for r, sampled in zip(batch.reqs, batch.sampled):
            if sampled and r.rid not in first_token and r.output_ids:
                first_token[r.rid] = clock
    # measured as the record measures: requests that arrived in the run (a warm-up before it is simulated, not
    # counted), from the first arrival to the last finish
    measured = [rid for rid, t in arrival.items() if t >= 0]
    out_tokens = sum(len(live[rid].output_ids) for rid in measured)
    ttfts = [first_token[r] - arrival[r] for r in measured if r in first_token]
    prompt_tokens = sum(len(live[rid].prompt_ids) for rid in measured)
    ends = [finish[r] for r in measured if r in finish]
    duration = max(ends) - min(arrival[r] for r in measured) if ends else 0.0
    return Outcome(
        ttft_p50=percentile(ttfts, 50),
        ttft_p99=percentile(ttfts, 99),
        output_tok_s=out_tokens / max(duration, 1e-9),
        cache_hit_rate=sum(hits.get(r, 0) for r in measured) / max(prompt_tokens, 1),
        duration=duration,
    )


def recorded(run: RunRecord) -> Outcome:
    """The same measures from the run's own record (its requests' metrics)."""
    reqs = run.requests
    ttfts = [m["ttft"] for m in reqs if m.get("ttft") is not None]
    arrivals = [m["arrival"] for m in reqs if m.get("arrival") is not None]
    finishes = [m["finish"] for m in reqs if m.get("finish") is not None]
    duration = (max(finishes) - min(arrivals)) if arrivals and finishes else 0.0
    out = sum(m.get("output_tokens", 0) for m in reqs)
    prompt = sum(m.get("prompt_tokens", 0) for m in reqs)
    return Outcome(
        ttft_p50=percentile(ttfts, 50),
        ttft_p99=percentile(ttfts, 99),
        output_tok_s=out / max(duration, 1e-9),
        cache_hit_rate=sum(m.get("cached_tokens", 0) for m in reqs) / max(prompt, 1),
        duration=duration,
    )


@dataclass
class Prediction:
    overrides: dict
    recorded: Outcome
    baseline: Outcome  # the simulation with nothing changed: the model's own bias on this run
    predicted: Outcome
    model: CostModel
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "overrides": self.overrides,
            "recorded": self.recorded.row(),
            "simulated_recorded_settings": self.baseline.row(),
            "predicted": self.predicted.row(),
            "model": {
                "features": list(FEATURES),
                "coef_s": [float(c) for c in self.model.coef],
                "r2": self.model.r2,
                "mean_abs_err": self.model.mean_abs_err,
                "steps": self.model.num_steps,
            },
            "notes": self.notes,
        }

    def table(self) -> str:
        def f(x: float | None, scale: float = 1.0, fmt: str = "{:.3f}") -> str:
            return "-" if x is None else fmt.format(x * scale)

        rows = [("", "recorded", "simulated (recorded settings)", "predicted")]
        for label, key, scale, fmt in (
            ("TTFT p50 (s)", "ttft_p50", 1.0, "{:.3f}"),
            ("TTFT p99 (s)", "ttft_p99", 1.0, "{:.3f}"),
            ("output tok/s", "output_tok_s", 1.0, "{:.1f}"),
            ("cache hit rate", "cache_hit_rate", 100.0, "{:.1f}%"),
        ):
            rows.append(
                (
                    label,
                    f(getattr(self.recorded, key), scale, fmt),
                    f(getattr(self.baseline, key), scale, fmt),
                    f(getattr(self.predicted, key), scale, fmt),
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [f"what-if: {', '.join(f'{k}={v}' for k, v in self.overrides.items())}"]
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
        lines.append("  " + self.model.describe())
        lines += ["  note: " + n for n in self.notes]
        return "\n".join(lines)


def predict(run: RunRecord, overrides: dict) -> Prediction:
    if not run.journal:
        raise JournalError(f"run {run.name!r} has no journal")
    config_of(run.journal, overrides)  # a bad combination fails here, before the work
    reqs = traffic(run)
    model = CostModel.fit(run.journal)
    notes = []
    if run.journal[0].get("drafter"):
        notes.append("the run used speculative decoding; the simulation decodes plainly")
    return Prediction(
        overrides=dict(overrides),
        recorded=recorded(run),
        baseline=simulate(run, reqs, model, {}),
        predicted=simulate(run, reqs, model, overrides),
        model=model,
        notes=notes,
    )
