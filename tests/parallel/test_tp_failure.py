"""A worker killed under an in-process session: the next step's requests end with a TPError naming
it (no hang), every later step fails the same way, and the process can start a new session."""

from __future__ import annotations

import os
import signal
import time

import torch

from minisched.engine import Engine
from minisched.model.config import preset
from minisched.parallel import ModelSource, TPError, TPSession
from minisched.sched.sampling_params import SamplingParams

SAMPLING = SamplingParams(max_new_tokens=3, ignore_eos=True)


def test_killed_worker_fails_requests_then_a_new_session_works():
    source = ModelSource(config=preset("tiny"), seed=0)
    threads = torch.get_num_threads()
    session = TPSession.start(2, source, timeout=20, startup_timeout=300)
    try:
        engine = Engine(tp_session=session, page_size=4)
        good = engine.generate([[5, 6, 7]], SAMPLING)[0].token_ids
        assert engine.health() is None
        worker = session.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        t0 = time.monotonic()
        out = engine.generate([[5, 6, 7], [8, 9]], SAMPLING)
        assert time.monotonic() - t0 < 10
        why = f"tensor parallelism failed: worker rank 1 (pid {worker.pid}) was killed by signal SIGKILL"
        assert all(o.finish_reason == "error" and why in o.error for o in out), [o.error for o in out]
        assert isinstance(engine.last_error, TPError)
        assert engine.health() == why  # what /health reports (503)
        assert engine.generate([[1, 2]], SAMPLING)[0].error.endswith(why)  # fails fast, same reason
        engine.scheduler.check_invariants()
    finally:
        session.close()
        torch.set_num_threads(threads)
    try:
        with TPSession.start(2, source, timeout=20, startup_timeout=300) as again:
            assert Engine(tp_session=again, page_size=4).generate([[5, 6, 7]], SAMPLING)[0].token_ids == good
        assert [p.exitcode for p in again.procs] == [0]
    finally:
        torch.set_num_threads(threads)


def test_idle_longer_than_the_timeout_is_not_a_failure():
    """Workers wait for the next step at most the collective timeout: rank 0's heartbeats (every
    quarter of it) keep an idle session alive."""
    threads = torch.get_num_threads()
    try:
        with TPSession.start(2, ModelSource(config=preset("tiny"), seed=0), timeout=4, startup_timeout=300) as s:
            engine = Engine(tp_session=s, page_size=4)
            first = engine.generate([[5, 6, 7]], SAMPLING)[0].token_ids
            sent = s.group.stats.snapshot()["broadcast"][0]
            time.sleep(6)
            assert s.group.stats.snapshot()["broadcast"][0] > sent  # NOOPs went out
            assert s.failure is None and s.procs[0].exitcode is None
            assert engine.generate([[5, 6, 7]], SAMPLING)[0].token_ids == first
        assert [p.exitcode for p in s.procs] == [0]
    finally:
        torch.set_num_threads(threads)


def test_rank_0_loading_longer_than_the_timeout_is_not_a_failure(monkeypatch):
    """A worker ready first waits for rank 0 under the startup timeout, not the collective one."""
    from minisched.parallel import launch

    real = launch.shard_model

    def slow(*args, **kwargs):  # rank 0 only: the spawned worker imports the module afresh
        time.sleep(5)
        return real(*args, **kwargs)

    monkeypatch.setattr(launch, "shard_model", slow)
    threads = torch.get_num_threads()
    try:
        with TPSession.start(2, ModelSource(config=preset("tiny"), seed=0), timeout=2, startup_timeout=300) as s:
            assert Engine(tp_session=s, page_size=4).generate([[5, 6, 7]], SAMPLING)[0].error is None
        assert [p.exitcode for p in s.procs] == [0]
    finally:
        torch.set_num_threads(threads)
