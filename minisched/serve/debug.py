"""GET /debug/requests/{id}: the story of a recent request (sched/story.py), told by the engine that ran it.

`request_stories(call_id, engine)` runs on the engine's thread (`ServingLoop.call_all`: every replica with
--dp N; functools.partial of it pickles) over the scheduler's records since their last drain (the server
keeps a few thousand steps: older requests are gone, a 404). A call's requests are `<call id>-<index>`
(state.py); the route also takes the client's own X-Request-Id, which the server maps to its call id."""

from __future__ import annotations

from minisched.sched.req import ReqStatus
from minisched.sched.story import lives, render, story_segments

ENDED = (ReqStatus.FINISHED, ReqStatus.ABORTED)


def request_stories(call_id: str, engine) -> list[dict]:
    """The stories of the engine requests of one call (or of one engine request id)."""
    records = engine.scheduler.records()
    endings = [(e.rid, e.step, e.dst.value, e.note) for e in records.events if e.dst in ENDED]
    by_rid, times = lives(records.journal, endings)
    out = []
    for rid, mine in by_rid.items():
        if rid == call_id or rid.startswith(call_id + "-"):
            life = mine[-1]
            out.append(
                {
                    "rid": rid,
                    "story": render(life, times, None),
                    "segments": [
                        {"first_step": a, "last_step": b, "text": t} for a, b, t in story_segments(life, times)
                    ],
                }
            )
    return out
