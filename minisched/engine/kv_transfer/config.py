"""`TransferConfig`: the waits of a KV transfer and the bounds on what a peer may send, frozen and checked.

Every wait of either side ends by one of these (a room then fails, and the peer is told):

- `bootstrap_timeout` (prefill side): a room the prefill worker has (its request arrived) waits this
  long for the decode side to announce it; an announcement for a room the prefill worker never gets
  waits as long, then the decode side is told to abort. SGLang's SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT
  is 300 s.
- `transfer_timeout` (decode side): an announced room waits this long for the next frame from the
  prefill side (pages or done). It spans the prefill side's queueing and compute, so it is long:
  SGLang's SGLANG_DISAGGREGATION_WAITING_TIMEOUT is 300 s.
- `ack_timeout` (prefill side): after its done frame is written, a room waits this long for the decode
  side to confirm the pages are in its pool.
- `connect_timeout` (decode side): TCP connect plus the bootstrap handshake; (prefill side) an accepted
  connection must say hello within it.
- `send_timeout` (both): a write the peer does not drain in this long ends the connection (a peer
  that stopped reading is a dead peer).

Bounds: a frame's JSON part is at most `max_meta_bytes`; a page batch at most `max_frame_bytes`
(or one page, when a page is larger); the decode side tells the prefill side its own limit at hello.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class TransferConfig:
    bootstrap_timeout: float = 300.0
    transfer_timeout: float = 300.0
    ack_timeout: float = 30.0
    connect_timeout: float = 10.0
    send_timeout: float = 30.0
    max_meta_bytes: int = 16 << 20
    max_frame_bytes: int = 32 << 20

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not value > 0
                or not math.isfinite(value)
            ):
                raise ValueError(f"TransferConfig.{f.name} must be a finite number > 0, got {value!r}")
        for name in ("max_meta_bytes", "max_frame_bytes"):
            if not isinstance(getattr(self, name), int):
                raise ValueError(f"TransferConfig.{name} must be an int, got {getattr(self, name)!r}")

    @property
    def tick(self) -> float:
        """How often the deadlines are looked at: a tenth of the shortest wait, within [10 ms, 500 ms]."""
        shortest = min(self.bootstrap_timeout, self.transfer_timeout, self.ack_timeout, self.connect_timeout)
        return min(0.5, max(0.01, shortest / 10))
