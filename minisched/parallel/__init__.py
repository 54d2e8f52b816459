"""Tensor parallelism: one model split over several processes (`minisched ... --tp N`).

Between the model and the engine (the engine imports it, never the other way). Rank 0 runs the Engine (scheduler, radix cache, sampling);
the other ranks hold a shard of the model and a KV pool of their heads, and run every step rank 0
sends them. The pieces, lowest first:

  group.py     TPGroup: torch.distributed (gloo on CPU, NCCL on CUDA) with timeouts; byte/time accounting
  shard.py     ShardPlan and shard_model: Megatron-style slices of a LlamaModel; TPShard, its `tp` hook
  protocol.py  the header and the ONE packed int tensor rank 0 broadcasts per step
  worker.py    worker_loop: what the ranks > 0 run
  launch.py    TPSession (spawn or torchrun, readiness, heartbeats, failure detection, `run_step` for
               rank 0's ModelRunner, close); source.py: ModelSource, what every rank loads

The engine builds a session itself (`Engine("smollm2", tp=2)`, engine/build.py); by hand:

    from minisched import Engine
    from minisched.parallel import ModelSource, TPSession
    with TPSession.start(2, ModelSource("smollm2")) as session:
        engine = Engine(tp_session=session, page_size=16)
        print(engine.generate(["Hello"])[0].text)
"""

from minisched.parallel.group import CommStats, TPError, TPGroup
from minisched.parallel.launch import (
    DEFAULT_STARTUP_TIMEOUT,
    DEFAULT_TIMEOUT,
    ModelSource,
    TPSession,
    run_torchrun_worker,
    torchrun_env,
)
from minisched.parallel.shard import ShardPlan, TPShard, check_tp, shard_model

__all__ = [
    "CommStats",
    "DEFAULT_STARTUP_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "ModelSource",
    "ShardPlan",
    "TPError",
    "TPGroup",
    "TPSession",
    "TPShard",
    "check_tp",
    "run_torchrun_worker",
    "shard_model",
    "torchrun_env",
]
