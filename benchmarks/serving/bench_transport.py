"""Which transport between the server and its engine process: a `multiprocessing.Pipe` with pickle
(what serve/replica.py uses) against pyzmq (what SGLang and vLLM use) with pickle and with msgpack.

    python benchmarks/serving/bench_transport.py [--batch 1 8 64] [--rounds 3] [--json out.json]

One message is one engine step's updates: a list of (request id, Update) with one new token each,
for `batch` requests. Measured: the round trip of one message (a ping-pong between two
processes, median of 2,000) and one-way messages per second (20,000 sent, the receiver counts),
interleaved A, B, C per round. The engine's step is 10-400 ms on this CPU, so what matters is
that the transport costs a negligible fraction of it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pickle
import statistics
import time

from minisched.serve.messages import Update


def step_message(batch: int) -> list:
    return [(f"cmpl-0123456789ab{i:x}-0", Update([1000 + i])) for i in range(batch)]


def encode_msgpack(msg: list) -> bytes:
    import msgpack

    return msgpack.packb([(rid, u.token_ids, u.finish_reason, u.cached_tokens) for rid, u in msg])


def decode_msgpack(data: bytes) -> list:
    import msgpack

    return [(rid, Update(ids, fr, cached_tokens=c)) for rid, ids, fr, c in msgpack.unpackb(data)]


# -- the echo side (another process) -------------------------------------------------------------
def pipe_echo(conn, n_one_way: int) -> None:
    while True:
        msg = conn.recv()
        if msg == "oneway":
            for _ in range(n_one_way):
                conn.recv()
            conn.send("done")
        elif msg == "stop":
            return
        else:
            conn.send(msg)


def zmq_echo(addr: str, codec: str, n_one_way: int) -> None:
    import zmq

    sock = zmq.Context().socket(zmq.PAIR)
    sock.connect(addr)
    loads = pickle.loads if codec == "pickle" else decode_msgpack
    while True:
        data = sock.recv()
        if data == b"oneway":
            for _ in range(n_one_way):
                loads(sock.recv())
            sock.send(b"done")
        elif data == b"stop":
            return
        else:
            loads(data)
            sock.send(data)


def measure(kind: str, batch: int, pings: int, n_one_way: int) -> dict:
    ctx = mp.get_context("spawn")
    msg = step_message(batch)
    if kind == "pipe+pickle":
        a, b = ctx.Pipe()
        p = ctx.Process(target=pipe_echo, args=(b, n_one_way))
        p.start()
        send, recv = a.send, a.recv
        stop = lambda: a.send("stop")  # noqa: E731
        oneway_start, oneway_end = (lambda: a.send("oneway")), (lambda: a.recv())
        one = lambda: a.send(msg)  # noqa: E731
    else:
        import zmq

        codec = kind.split("+")[1]
        dumps = (lambda m: pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL)) if codec == "pickle" else encode_msgpack
        loads = pickle.loads if codec == "pickle" else decode_msgpack
        sock = zmq.Context().socket(zmq.PAIR)
        addr = f"ipc:///tmp/minisched-bench-{os.getpid()}.ipc"
        sock.bind(addr)
        p = ctx.Process(target=zmq_echo, args=(addr, codec, n_one_way))
        p.start()
        send = lambda m: sock.send(dumps(m))  # noqa: E731
        recv = lambda: loads(sock.recv())  # noqa: E731
        stop = lambda: sock.send(b"stop")  # noqa: E731
        oneway_start, oneway_end = (lambda: sock.send(b"oneway")), (lambda: sock.recv())
        one = lambda: sock.send(dumps(msg))  # noqa: E731
    send(msg)
    recv()  # warm up (the child is up)
    rtts = []
    for _ in range(pings):
        t0 = time.perf_counter()
        send(msg)
        recv()
        rtts.append(time.perf_counter() - t0)
    oneway_start()
    t0 = time.perf_counter()
    for _ in range(n_one_way):
        one()
    oneway_end()
    rate = n_one_way / (time.perf_counter() - t0)
    stop()
    p.join(10)
    return {
        "kind": kind,
        "batch": batch,
        "rtt_us": 1e6 * statistics.median(rtts),
        "msgs_per_s": rate,
        "bytes": len(pickle.dumps(msg)) if "pickle" in kind else len(encode_msgpack(msg)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    kinds = ["pipe+pickle", "zmq+pickle", "zmq+msgpack"]
    rows = []
    for r in range(args.rounds):
        for batch in args.batch:
            for kind in kinds[r % 3 :] + kinds[: r % 3]:  # a different order each round
                rows.append({"round": r, "load": os.getloadavg()[0], **measure(kind, batch, 2000, 20000)})
    print(f"{'transport':14}{'batch':>6}{'bytes':>7}{'RTT us':>9}{'msgs/s':>10}")
    summary = []
    for batch in args.batch:
        for kind in kinds:
            mine = [x for x in rows if x["kind"] == kind and x["batch"] == batch]
            rtt, rate = statistics.median(x["rtt_us"] for x in mine), statistics.median(x["msgs_per_s"] for x in mine)
            summary.append({"kind": kind, "batch": batch, "rtt_us": rtt, "msgs_per_s": rate, "bytes": mine[0]["bytes"]})
            print(f"{kind:14}{batch:>6}{mine[0]['bytes']:>7}{rtt:>9.0f}{rate:>10.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "bench_transport", "rows": rows, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
