"""One end of a KV transfer in a process of its own, for the tests that kill a peer mid-transfer.

    python -I tests/helpers/kv_peer.py prefill --room R --pages N --send K
        serves on a free port (prints `port P`), waits for room R's announcement, sends its first K of
        N pages (prints `sent K`), then waits to be killed
    python -I tests/helpers/kv_peer.py decode --port P --room R --pages N
        announces room R (N pages) to the prefill worker at 127.0.0.1:P, prints `state S` at every
        change of the room's state (it polls: pages land in its pool), and waits to be killed

The pool layout is the tests' default (helpers.kv_transfer.random_pool: 3 layers, 2 heads, dim 8),
page size 16, float32, model "m".
"""

from __future__ import annotations

import argparse
import time

# isort: off
import minisched  # noqa: F401  (before torch: the OpenMP wait policy, as every entry point)
import torch
from minisched.engine.kv_transfer import DecodeTransfer, EventKind, PrefillTransfer, TransferConfig

# isort: on

CONFIG = TransferConfig(bootstrap_timeout=60, transfer_timeout=60, ack_timeout=60, connect_timeout=30)


def pool(num_pages: int) -> torch.Tensor:
    return torch.randn(3, 2, num_pages, 16, 2, 8, generator=torch.Generator().manual_seed(7))


def prefill(room: int, pages: int, send: int) -> None:
    with PrefillTransfer(pool(pages), "m", config=CONFIG) as xfer:
        print("port", xfer.port, flush=True)
        xfer.expect(room)
        while not any(ev.room == room and ev.kind == EventKind.READY for ev in xfer.poll()):
            time.sleep(0.01)
        xfer.send_pages(room, list(range(send)))
        print("sent", send, flush=True)
        while True:
            time.sleep(1)


def decode(port: int, room: int, pages: int) -> None:
    with DecodeTransfer(torch.zeros_like(pool(pages)), "m", config=CONFIG) as xfer:
        xfer.expect(room, "127.0.0.1", port, list(range(pages)))
        last = None
        while True:
            xfer.poll()
            state = xfer.state(room)
            if state != last:
                print("state", state.value if state is not None else None, flush=True)
                last = state
            time.sleep(0.01)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("role", choices=["prefill", "decode"])
    ap.add_argument("--port", type=int)
    ap.add_argument("--room", type=int, required=True)
    ap.add_argument("--pages", type=int, required=True)
    ap.add_argument("--send", type=int, default=0)
    args = ap.parse_args()
    if args.role == "prefill":
        prefill(args.room, args.pages, args.send)
    else:
        decode(args.port, args.room, args.pages)


if __name__ == "__main__":
    main()
