"""Each request's story from a run file (`minisched explain`): sched/story.py over the run's journal, with
the run's per-request metrics (TTFT, e2e) in each story's first line.

A request is named by its engine id (`r3`, `cmpl-...-0`), by its call's id (`cmpl-...`: every choice and
prompt of the call) or, in a `serve --record` file, by the client's X-Request-Id (the file's `client_ids`).
A `serve --record` segment after the first starts with the requests it `carried` over (story.py)."""

from __future__ import annotations

from minisched.observe.run_record import RunRecord
from minisched.sched.story import Life, lives, render, story_segments


def _lives(record: RunRecord) -> tuple[dict[str, list[Life]], dict[int, float]]:
    endings = [
        (e["rid"], int(e.get("step", 0)), e["dst"], e.get("note") or "")
        for e in record.events
        if e.get("dst") in ("finished", "aborted")
    ]
    return lives(record.carried + record.journal, endings)


def named(record: RunRecord, wanted: str, known: list[str]) -> list[str]:
    """The request ids of `known` that `wanted` names: itself, its call's requests, or a client id's."""
    names = record.client_ids.get(wanted, [wanted])
    return [rid for rid in known if any(rid == n or rid.startswith((n + "-", n + "#")) for n in names)]


def stories(record: RunRecord, rids: list[str] | None = None, slowest: int | None = None) -> list[str]:
    """The stories of `rids` (all by default; the `slowest` worst TTFTs if given, then requests without one)."""
    if not record.journal:
        raise ValueError(f"run {record.name!r} has no journal (recorded before decisions were journalled)")
    by_rid, times = _lives(record)
    metrics = {m["rid"]: m for m in record.requests}
    if slowest is not None:
        ranked = sorted((m for m in record.requests if m.get("ttft") is not None), key=lambda m: -m["ttft"])
        rids = [m["rid"] for m in ranked[:slowest]]
        # a `serve --record` segment's requests that arrived before it have no TTFT there: they come next
        rids += [rid for rid in by_rid if rid not in rids][: slowest - len(rids)]
    chosen: list[str] = []
    for wanted in list(by_rid) if rids is None else rids:
        found = named(record, wanted, list(by_rid)) if rids is not None else [wanted]
        if not found:
            raise ValueError(f"no request {wanted!r} in run {record.name!r}")
        chosen += [rid for rid in found if rid not in chosen]
    return [render(life, times, metrics.get(rid)) for rid in chosen for life in by_rid[rid]]


def request_story(record: RunRecord, rid: str) -> list[tuple[int, int, str]]:
    """The story of the last life of `rid` as segments ([] if unknown)."""
    by_rid, times = _lives(record)
    return story_segments(by_rid[rid][-1], times) if rid in by_rid else []


def story_marks(record: RunRecord) -> dict[str, list[tuple[float, str, str]]]:
    """Per request id: (time of its first step, steps, text) of each story segment, for the trace's and the
    HTML report's rows ({} without a journal)."""
    if not record.journal:
        return {}
    by_rid, times = _lives(record)
    out: dict[str, list[tuple[float, str, str]]] = {}
    for rid, mine in by_rid.items():
        life = mine[-1]
        rows = []
        for a, b, text in story_segments(life, times):
            t = times.get(a, life.arrival_t) if text != "arrived" else life.arrival_t
            rows.append((t, f"{a}" if a == b else f"{a}-{b}", text))
        out[rid] = rows
    return out


def story_texts(record: RunRecord) -> dict[str, str]:
    """Per request id: its story as text ({} without a journal)."""
    if not record.journal:
        return {}
    by_rid, times = _lives(record)
    metrics = {m["rid"]: m for m in record.requests}
    return {rid: render(mine[-1], times, metrics.get(rid)) for rid, mine in by_rid.items()}
