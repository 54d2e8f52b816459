"""A request's story from the scheduler's journal (journal.py): why it waited, how it ran.

`lives(journal, endings)` walks the journal's builds once and turns each request's part in them into
items in step order; `story_segments` merges consecutive waits (one line per waiting phase, its
reasons by the steps each cost) and decode steps; `render` gives the text:

    r12: 812-token prompt, 48 tokens out (max_new_tokens), TTFT 1.92 s, e2e 4.10 s
      step 3        arrived
      steps 4-6     waited 3 steps (0.31 s): the prefill token budget was spent (by r10, r11)
      step 7        admitted: 96 cached tokens, chunk 1 of 3 (256 new tokens, 22 pages)
      steps 9-40    decoded in 32 steps (1.40 s)
      step 41       retracted: the next decode step's pages ran out (chosen over r3, r5)

A waiting request named in no decision of a build was offered after the request that build stopped
at, so it waits behind that one for the same reason ("behind r7: its KV pages did not fit"). Times
come from the builds' timestamps (a phase lasts from its first build to the build after its last).
`endings` are (rid, step, status, note) of the requests' ends (the scheduler's events). A journal may
start with the `carried` add entries of a `serve --record` segment (observe/record_series.py): requests
that arrived before it, with their arrival `step`, `prompt_len` and whether they were `waiting`. Used by
`minisched explain` (observe/explain.py) and the server's /debug/requests/{id}. Pure Python.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from minisched.sched.decisions import TEXT, Reason


@dataclass
class Life:
    rid: str
    arrival_step: int
    arrival_t: float
    prompt_len: int
    items: list[tuple[int, str, object]] = field(default_factory=list)  # (step, kind, detail) in order
    chunks: list[tuple[int, int, int, bool, int, int]] = field(default_factory=list)  # open admission's chunks


def _reason_text(reason: str, by: list | tuple) -> str:
    try:
        text = TEXT[Reason(reason)]
    except ValueError:
        text = "it was not offered" if reason == "not_offered" else reason
    return f"{text} (by {', '.join(by)})" if by else text


def _retract_text(rule: str, by: list) -> str:
    if rule.startswith("preempted_for:"):
        head = rule.split(":", 1)[1]
        return f"preempted for the more urgent {head}" + (f" (chosen over {', '.join(by)})" if by else "")
    return "retracted: the next decode step's pages ran out" + (f" (chosen over {', '.join(by)})" if by else "")


def lives(
    journal: Iterable[dict], endings: Iterable[tuple[str, int, str, str]]
) -> tuple[dict[str, list[Life]], dict[int, float]]:
    """Each request's lives (a request id may be reused after it ended) and each build's time."""
    out: dict[str, list[Life]] = {}
    live: dict[str, Life] = {}
    waiting: dict[str, Life] = {}
    times: dict[int, float] = {}
    step = 0

    def flush_chunks(life: Life) -> None:
        n = len(life.chunks)
        for k, (s, prefix, new, _trunc, pages, host) in enumerate(life.chunks):
            if n == 1:
                what = f"admitted: {prefix} cached tokens, {new} new tokens, {pages} pages"
            elif k == 0:
                what = f"admitted: {prefix} cached tokens, chunk 1 of {n} ({new} new tokens, {pages} pages)"
            else:
                what = f"chunk {k + 1} of {n} ({new} new tokens, {pages} pages)"
            if host:
                what += f", {host} tokens loaded back from the host tier"
            life.items.append((s, "admit", what))
        life.chunks.clear()

    for e in journal:
        op = e.get("op")
        if op == "add":  # a carried request (a `serve --record` segment's start) names its step and state
            prompt_len = int(e["prompt_len"]) if "prompt_len" in e else len(e.get("prompt", ()))
            born = Life(e["rid"], int(e.get("step", step)), float(e.get("t", 0.0)), prompt_len)
            out.setdefault(born.rid, []).append(born)
            live[born.rid] = born
            if e.get("waiting", True):
                waiting[born.rid] = born
            arrived = (
                "arrived" if "step" not in e else "arrived (before this file: its earlier steps are in earlier files)"
            )
            born.items.append((born.arrival_step, "arrive", arrived))
        elif op == "build":
            step = int(e["step"])
            times[step] = float(e.get("t", 0.0))
            why = e.get("why", {})
            told: set[str] = set()
            for rid, prefix, new, trunc, pages, host in why.get("admitted", ()):
                life = live.get(rid)
                if life is None:
                    continue
                told.add(rid)
                waiting.pop(rid, None)
                life.chunks.append((step, prefix, new, trunc, pages, host))
                if not trunc:
                    flush_chunks(life)
            for rid, reason, by in why.get("skipped", ()):
                if rid in waiting:
                    told.add(rid)
                    waiting[rid].items.append((step, "wait", (reason, None, tuple(by))))
            stopped = why.get("stopped")
            if stopped is not None and stopped[0] in waiting:
                told.add(stopped[0])
                waiting[stopped[0]].items.append((step, "wait", (stopped[1], None, tuple(stopped[2]))))
            for rid, rule, by in why.get("retracted", ()):
                life = live.get(rid)
                if life is not None:
                    flush_chunks(life)
                    life.items.append((step, "retract", _retract_text(rule, by)))
                    waiting[rid] = life
                    told.add(rid)
            behind: tuple[str, str | None, tuple[str, ...]]
            if why.get("no_prefill"):
                behind = (why["no_prefill"], None, ())
            elif stopped is not None:
                behind = (stopped[1], stopped[0], tuple(stopped[2]))
            else:
                trunc = tuple(a[0] for a in why.get("admitted", ()) if a[3])
                behind = (Reason.CHUNK_BUDGET.value, None, trunc) if trunc else ("not_offered", None, ())
            for rid, life in waiting.items():
                if rid not in told:
                    life.items.append((step, "wait", behind))
            admitted = {a[0] for a in why.get("admitted", ())}
            mode = e.get("mode")
            for rid in e.get("rids", ()):
                life = live.get(rid)
                if life is not None and rid not in admitted and mode in ("decode", "mixed", "verify"):
                    life.items.append((step, "decode", "verify" if mode == "verify" else "decode"))
    for rid, at, status, note in endings:  # the endings (finish reason, abort), at the step they happened
        for life in reversed(out.get(rid, [])):
            if life.arrival_step <= at:
                flush_chunks(life)
                life.items.append((at, "end", f"{status} ({note or status})"))
                break
    return out, times


def _span(times: dict[int, float], a: int, b: int) -> float | None:
    """Seconds from build a to the build after b (or b's own time, at the end of the run)."""
    if a not in times:
        return None
    end = times.get(b + 1, times.get(b))
    return None if end is None else max(0.0, end - times[a])


def _top(names: list[str], k: int = 4) -> list[str]:
    counts: dict[str, int] = {}
    for n in names:
        counts[n] = counts.get(n, 0) + 1
    return sorted(counts, key=lambda n: -counts[n])[:k]


def _wait_text(waits: list[tuple[str, str | None, tuple[str, ...]]]) -> str:
    """One waiting phase: its reasons by the steps each cost, with who held the resource and whom it
    queued behind."""
    by_reason: dict[str, list] = {}
    for w in waits:
        by_reason.setdefault(w[0], []).append(w)
    parts = []
    for reason, ws in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
        text = _reason_text(reason, _top([b for w in ws for b in w[2]]))
        behind = _top([w[1] for w in ws if w[1] is not None], 3)
        if behind:
            text = f"behind {', '.join(behind)}: {text}"
        n = len(ws)
        parts.append(text + (f" [{n} step{'s' if n > 1 else ''}]" if len(by_reason) > 1 else ""))
    return "; ".join(parts)


def story_segments(life: Life, times: dict[int, float]) -> list[tuple[int, int, str]]:
    """(first step, last step, text) of one life: each waiting phase and each run of decode steps is one
    segment."""
    out: list[tuple[int, int, str]] = []
    items = sorted(life.items, key=lambda it: it[0])  # stable: same-step items keep their order
    i = 0
    while i < len(items):
        s, kind, what = items[i]
        j = i
        if kind in ("wait", "decode"):
            while j + 1 < len(items) and items[j + 1][1] == kind:
                j += 1
        t = items[j][0]
        n = t - s + 1
        dur = _span(times, s, t)
        secs = "" if dur is None else f" ({dur:.2f} s)"
        if kind == "wait":
            waits = [it[2] for it in items[i : j + 1]]
            text = f"waited {n} step{'s' if n > 1 else ''}{secs}: {_wait_text(waits)}"  # type: ignore[arg-type]
        elif kind == "decode":
            verb = "verified" if what == "verify" else "decoded"
            text = f"{verb} in {n} step{'s' if n > 1 else ''}{secs}"
        else:
            text = str(what)
        out.append((s, t, text))
        i = j + 1
    return out


def _header(life: Life, metrics: dict | None) -> str:
    parts = [f"{life.rid}: {life.prompt_len}-token prompt"]
    if metrics is not None:
        parts.append(f"{metrics.get('output_tokens', 0)} tokens out ({metrics.get('finish_reason') or 'live'})")
        for key, label in (("ttft", "TTFT"), ("e2e_latency", "e2e")):
            if metrics.get(key) is not None:
                parts.append(f"{label} {metrics[key]:.2f} s")
        if metrics.get("cached_tokens"):
            parts.append(f"{metrics['cached_tokens']} cached")
    return ", ".join(parts)


def render(life: Life, times: dict[int, float], metrics: dict | None) -> str:
    lines = [_header(life, metrics)]
    for a, b, text in story_segments(life, times):
        where = f"step {a}" if a == b else f"steps {a}-{b}"
        lines.append(f"  {where:<14}{text}")
    return "\n".join(lines)
