"""The ranks > 0: `worker_loop` runs every step rank 0 sends.

Rank 0 holds the Engine (scheduler, radix cache, sampling); its runner is the ordinary
`ModelRunner` (inputs, cascade groups, per-request generators, sampling) whose forward proper
goes through `TPSession.run_step` (launch.py): the step to the other ranks, then its own shard.
The workers hold a sharded model and a KV pool, nothing else: no requests, no page bookkeeping.
They run the same forward on what they receive; the collectives inside it keep the ranks in
step, and the logits end up on rank 0.
"""

from __future__ import annotations

import sys

import torch

from minisched import ops
from minisched.model.llama import LlamaModel
from minisched.parallel import protocol
from minisched.parallel.group import TPGroup


def worker_loop(group: TPGroup, model: LlamaModel) -> None:
    """A rank > 0 until STOP: wait for a header (bounded: rank 0 sends heartbeats while idle), act on it.
    A failed collective raises (the group is then unusable; the caller exits)."""
    h = torch.empty(protocol.HEADER_LEN, dtype=torch.int64, device=group.device)
    kv_cache, backend, check = None, "torch", False
    while True:
        group.broadcast(h)
        head = h.tolist()
        op = head[0]
        if op == protocol.STOP:
            return
        if op == protocol.NOOP:
            continue
        if op == protocol.SETUP:
            kv_cache = None  # free the old pool first
            kv_cache = model.new_kv_cache(head[1], head[2])
            backend, check = ops.BACKENDS[head[3]], bool(head[4])
        elif op == protocol.STEP:
            if kv_cache is None:
                raise RuntimeError("a step before any engine was set up")
            payload = torch.empty(protocol.payload_len(head), dtype=torch.int32, device=group.device)
            group.broadcast(payload)
            input_ids, meta = protocol.unpack_step(head, payload)
            model(input_ids, meta, kv_cache, backend=backend, check=check)
        else:
            raise RuntimeError(f"unknown message {op} from rank 0")


def report_worker_error(rank: int, exc: BaseException) -> None:
    print(
        f"minisched: tensor-parallel rank {rank}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
        file=sys.stderr,
        flush=True,
    )
