"""KV pages from a prefill worker to a decode worker over TCP (prefill/decode disaggregation).

The router sends each request to a prefill worker and a decode worker at once, naming a room
(`bootstrap_room`) and the prefill worker's bootstrap address (`bootstrap_host`, `bootstrap_port`;
docs/fleet.md). The decode worker reserves pages for the request and announces the room to the
prefill worker; the prefill worker computes the prompt's KV and sends the pages as its chunks finish,
gathered with `ops.gather_kv_pages` into contiguous buffers; the decode worker writes them into its
pool with `ops.scatter_kv_pages` and decodes.

    PrefillTransfer   the prefill worker's end: the bootstrap server, expect / send_pages / finish
    DecodeTransfer    the decode worker's end: expect (announce) / refuse, pages into the pool
    poll()            on either: what ended (or, on the prefill side, became READY) since the last poll

Neither blocks its caller on the network: each runs an asyncio loop on a thread of its own, and the
caller (the engine loop) polls. Modules: layout (the layout both sides must share), config (the
timeouts and bounds), wire (the frames), link (the loop and one connection), rooms (states, events),
prefill, decode. tests/engine/test_kv_transfer.py runs both ends on loopback.
"""

from minisched.engine.kv_transfer.config import TransferConfig
from minisched.engine.kv_transfer.decode import DecodeTransfer
from minisched.engine.kv_transfer.layout import KVLayout, KVLayoutMismatch
from minisched.engine.kv_transfer.prefill import PrefillTransfer
from minisched.engine.kv_transfer.rooms import DecodeState, EventKind, PrefillState, RoomEvent, TransferStats

__all__ = [
    "DecodeState",
    "DecodeTransfer",
    "EventKind",
    "KVLayout",
    "KVLayoutMismatch",
    "PrefillState",
    "PrefillTransfer",
    "RoomEvent",
    "TransferConfig",
    "TransferStats",
]
