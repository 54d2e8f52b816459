"""What does moving a prompt's KV from a prefill to a decode worker cost over TCP?

For SmolLM2-135M's layout (30 layers, 3 KV heads, head_dim 64; page size 16), fp32 and bf16: the
bytes per token and per page, then rounds of one room of --pages pages through the transfer
(minisched/engine/kv_transfer/: gather on the prefill side in --chunk-page batches as chunked prefill
would, the frames over loopback TCP, scatter into the decode side's pool in its poll loop), timed from
the first send_pages to the decode side's DONE. The baseline in the same run: the same bytes over a
plain loopback TCP socket between two threads (sendall / recv_into, no framing, no copies kernels), and
the gather and scatter kernels alone on the same pages. Rounds interleave (transfer, socket, socket,
transfer, ...); the load average is recorded with each round: on a shared machine read the ratios.

    .venv/bin/python benchmarks/serving/bench_kv_transfer.py [--pages 128] [--rounds 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import threading
import time
from pathlib import Path

import torch

from minisched import ops
from minisched.engine.kv_transfer import DecodeTransfer, EventKind, KVLayout, PrefillTransfer, TransferConfig
from minisched.model.config import PRESETS

MODEL = "smollm2-135m"
PAGE_SIZE = 16


def pool(num_pages: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    cfg = PRESETS[MODEL]
    g = torch.Generator().manual_seed(seed)
    shape = (cfg.num_layers, 2, num_pages, PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim)
    return torch.randn(shape, generator=g).to(dtype)


def wait_event(endpoint, room: int, kind: EventKind, timeout: float = 120.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for ev in endpoint.poll():
            if ev.room == room:
                if ev.kind != kind:
                    raise RuntimeError(f"room {room}: {ev}")
                return time.perf_counter()
        time.sleep(0.0005)
    raise RuntimeError(f"room {room}: no {kind.value} in {timeout} s")


def transfer_round(p: PrefillTransfer, d: DecodeTransfer, room: int, pages: int, chunk: int) -> float:
    src, dst = list(range(pages)), list(range(pages))[::-1]  # reversed: the scatter is a real permutation
    p.expect(room)
    d.expect(room, "127.0.0.1", p.port, dst)
    wait_event(p, room, EventKind.READY)
    t0 = time.perf_counter()
    for i in range(0, pages, chunk):
        p.send_pages(room, src[i : i + chunk])
    p.finish(room, {"first_token": 1})
    t1 = wait_event(d, room, EventKind.DONE)
    wait_event(p, room, EventKind.DONE)
    return t1 - t0


def socket_round(nbytes: int) -> float:
    """nbytes over loopback TCP between two threads: the ceiling of what this host moves."""
    payload = memoryview(bytearray(os.urandom(1 << 20)) * (nbytes // (1 << 20) + 1))[:nbytes]
    sink = bytearray(1 << 22)
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        got = [0]

        def receive() -> None:
            conn, _ = server.accept()
            with conn:
                view = memoryview(sink)
                while got[0] < nbytes:
                    n = conn.recv_into(view)
                    if not n:
                        break
                    got[0] += n

        t = threading.Thread(target=receive)
        t.start()
        with socket.create_connection(("127.0.0.1", port)) as c:
            t0 = time.perf_counter()
            c.sendall(payload)
            t.join()
            t1 = time.perf_counter()
    assert got[0] == nbytes
    return t1 - t0


def kernels_round(kv_src: torch.Tensor, kv_dst: torch.Tensor, pages: int) -> tuple[float, float]:
    idx = torch.arange(pages, dtype=torch.int32)
    t0 = time.perf_counter()
    buf = ops.gather_kv_pages(kv_src, idx)
    t1 = time.perf_counter()
    ops.scatter_kv_pages(buf, kv_dst, idx.flip(0).contiguous())
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=128, help="pages per room (x16 tokens)")
    ap.add_argument("--chunk-pages", type=int, default=32, help="pages per send_pages call (a 512-token chunk)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/kv_transfer.json"))
    args = ap.parse_args()
    out: dict = {"model": MODEL, "page_size": PAGE_SIZE, "pages": args.pages, "rounds": [], "layouts": {}}
    config = TransferConfig(transfer_timeout=120, ack_timeout=120)
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        kv_src, kv_dst = pool(args.pages, dtype, 1), pool(args.pages, dtype, 2)
        layout = KVLayout.of(kv_src, MODEL)
        nbytes = args.pages * layout.bytes_per_page
        out["layouts"][dtype_name] = {
            "bytes_per_token": layout.bytes_per_token,
            "bytes_per_page": layout.bytes_per_page,
        }
        print(
            f"{dtype_name}: {layout.bytes_per_token} B/token, {layout.bytes_per_page} B/page, {nbytes / 1e6:.1f} MB a room"
        )
        with PrefillTransfer(kv_src, MODEL, config=config) as p, DecodeTransfer(kv_dst, MODEL, config=config) as d:
            transfer_round(p, d, 10**6, min(args.pages, 4), args.chunk_pages)  # connect + warm up
            for r in range(args.rounds):
                order = ("transfer", "socket") if r % 2 == 0 else ("socket", "transfer")
                for what in order:
                    load = os.getloadavg()[0]
                    if what == "transfer":
                        secs = transfer_round(p, d, r, args.pages, args.chunk_pages)
                    else:
                        secs = socket_round(nbytes)
                    row = {"dtype": dtype_name, "what": what, "seconds": secs, "load1": load}
                    row |= {"pages_per_s": args.pages / secs, "MB_per_s": nbytes / secs / 1e6}
                    out["rounds"].append(row)
                    print(
                        f"  {what:8s} {secs * 1e3:8.1f} ms  {row['pages_per_s']:9.0f} pages/s  {row['MB_per_s']:7.0f} MB/s  load {load:.1f}"
                    )
                g, s = kernels_round(kv_src, kv_dst, args.pages)
                out["rounds"].append(
                    {"dtype": dtype_name, "what": "gather+scatter", "seconds": g + s, "gather_s": g, "scatter_s": s}
                )
        for what in ("transfer", "socket"):
            rows = [x for x in out["rounds"] if x["dtype"] == dtype_name and x["what"] == what]
            med = statistics.median(x["pages_per_s"] for x in rows)
            print(f"  median {what}: {med:.0f} pages/s ({med * layout.bytes_per_page / 1e6:.0f} MB/s)")
        ks = [x for x in out["rounds"] if x["dtype"] == dtype_name and x["what"] == "gather+scatter"]
        print(
            f"  kernels alone: gather {statistics.median(x['gather_s'] for x in ks) * 1e3:.1f} ms, scatter {statistics.median(x['scatter_s'] for x in ks) * 1e3:.1f} ms"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
