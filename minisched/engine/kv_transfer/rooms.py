"""A room's states on each side of a transfer and what `poll()` reports.

A room is one request's KV on its way from the prefill worker to the decode worker; the router names
it (`bootstrap_room`, sent to both). Each side's endpoint keeps the room's state; the caller (the
scheduler, later) learns of changes only through `poll()`, and every room ends exactly once for it:
either `poll()` reports DONE or FAILED, or the caller ended it itself with `abort()` (then `poll()`
never reports it).

    prefill  BOOTSTRAPPING -> READY -> TRANSFERRING -> AWAITING_ACK -> DONE     (any -> FAILED)
             expect()        the decode    send_pages()   finish()        the decode side has the pages
                             side announced
    decode   CONNECTING -> WAITING -> RECEIVING -> RECEIVED -> DONE            (any -> FAILED)
             expect()      announced   pages come    done came   poll() put the pages in the pool
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, Optional


class PrefillState(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"  # waiting for the decode side's announcement (bootstrap_timeout)
    READY = "ready"  # announced: the decode side holds pages for it; prefill may run
    TRANSFERRING = "transferring"  # page batches queued or sent
    AWAITING_ACK = "awaiting_ack"  # done sent; waiting for the decode side's confirmation (ack_timeout)
    DONE = "done"
    FAILED = "failed"


class DecodeState(enum.Enum):
    CONNECTING = "connecting"  # connect + handshake with the prefill worker (connect_timeout)
    WAITING = "waiting"  # announced; no pages yet (transfer_timeout)
    RECEIVING = "receiving"  # pages arriving (transfer_timeout between frames)
    RECEIVED = "received"  # done arrived; the next poll() scatters what is left and ends it
    DONE = "done"
    FAILED = "failed"


class EventKind(enum.Enum):
    READY = "ready"  # prefill side: the decode side announced the room (pages, skip_pages)
    DONE = "done"  # the room ended well: prefill side: acknowledged; decode side: pages in the pool
    FAILED = "failed"  # the room ended badly (error says why); the caller frees what it holds


@dataclass(frozen=True)
class RoomEvent:
    room: int
    kind: EventKind
    pages: int = 0  # READY: pages the decode side reserved; DONE: pages moved
    skip_pages: int = 0  # READY: leading pages of the request's KV the decode side holds already
    metadata: Optional[dict[str, Any]] = None  # DONE, decode side: what the prefill side's finish() sent
    error: Optional[str] = None  # FAILED: why


@dataclass(frozen=True)
class TransferStats:
    """What an endpoint moved so far (payload bytes of page batches, both directions of its own role)."""

    pages: int = 0
    bytes: int = 0
    frames: int = 0
    rooms_done: int = 0
    rooms_failed: int = 0


def count_ends(stats: TransferStats, events: Iterable[RoomEvent]) -> TransferStats:
    """stats with the rooms these events end counted."""
    ends = [e.kind for e in events]
    done, failed = ends.count(EventKind.DONE), ends.count(EventKind.FAILED)
    return replace(stats, rooms_done=stats.rooms_done + done, rooms_failed=stats.rooms_failed + failed)
