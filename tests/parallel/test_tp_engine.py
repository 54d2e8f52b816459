"""`Engine(name, tp=N)` starts its tensor-parallel ranks itself (engine/build.py), in a module of its own:
a process holds one torch.distributed group at a time, and test_tp.py's sessions live per module."""

from __future__ import annotations

import torch

from minisched.engine import Engine
from minisched.sched.sampling_params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


def test_engine_tp_option_starts_and_closes_the_ranks():
    """`Engine(name, tp=2)` is tensor parallel from Python as from the CLI: it starts the second rank,
    gives the one-process engine's tokens, and `close()` (the `with` block) stops the rank."""
    ps = prompts([5, 17, 9])
    threads = torch.get_num_threads()
    try:
        with Engine("dummy:tiny", tp=2, page_size=4, num_threads=1) as eng:
            session = eng.tp_session
            assert session is not None and session.world == 2
            assert [p.is_alive() for p in session.procs] == [True]
            assert eng.kv_cache.shape[-2] == 1  # this rank's share of the (replicated) KV head
            outs = eng.generate(ps, GREEDY)
        assert session.closed and [p.exitcode for p in session.procs] == [0]
    finally:
        torch.set_num_threads(threads)
    refs = Engine("dummy:tiny", page_size=4, num_threads=1).generate(ps, GREEDY)
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    assert all(o.error is None for o in outs)
