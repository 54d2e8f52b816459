"""Starting, watching and stopping the ranks of a tensor-parallel engine (what they load: source.py).

    engine = Engine("smollm2", tp=2)                         # engine/build.py starts the session and owns it
    session = TPSession.start(2, ModelSource("smollm2"))     # or by hand: rank 0 spawns rank 1 (or joins torchrun's)
    engine = Engine(tp_session=session, page_size=16)        # an Engine whose runner drives every rank
    engine.generate([...]); session.close()                  # STOP to the workers, then join them

One node: rank 0 (this process) hosts a `TCPStore` on a free loopback port and spawns ranks
1..N-1 with `torch.multiprocessing` (spawn). Several nodes: `torchrun` starts every rank of the
same command (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, `LOCAL_RANK` in the
environment); rank 0 runs the command, the others call `run_torchrun_worker`. Either way each
rank loads the full weights on the CPU, keeps its shard (`shard_model`) and tells rank 0 through
the store ("hello" when connected, then "ready", or "error" with the reason), so a worker that
cannot start is a clear error on rank 0 within `startup_timeout`, never a hang.

Failures while running, all bounded:
- a worker process that exits (crash, OOM kill, `kill -9`): rank 0's monitor thread sees it
  within 0.2 s (one node) and its next -- or current -- collective fails at once (gloo: the peer's
  socket closes); the error names the rank, pid and signal;
- a worker that hangs: rank 0's collective times out after `timeout` seconds;
- rank 0 that dies or hangs: the workers' wait for the next header times out (rank 0 sends a NOOP
  heartbeat every `timeout/4` s while idle, so a healthy idle server never trips it), or their
  socket closes; they exit.
After a failure the session kills the other workers and every later step raises the same
`TPError`: the Engine turns it into errors of the affected requests, the CLI prints them.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

from minisched.base.cpus import default_num_threads
from minisched.model.llama import LlamaModel
from minisched.parallel import protocol
from minisched.parallel.group import TPError, TPGroup, seconds
from minisched.parallel.shard import check_tp, shard_model
from minisched.parallel.source import ModelSource
from minisched.parallel.worker import report_worker_error, worker_loop

DEFAULT_TIMEOUT = 60.0  # seconds a collective may wait for the slowest rank
DEFAULT_STARTUP_TIMEOUT = 600.0  # seconds the ranks may take to start and load their weights


# -- the environment: torchrun or not ------------------------------------------------------------------


def torchrun_env() -> Optional[dict]:
    """rank, world, local_rank, addr, port when this process was started by torchrun, else None."""
    env = os.environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    return dict(
        rank=int(env["RANK"]),
        world=int(env["WORLD_SIZE"]),
        local_rank=int(env.get("LOCAL_RANK", "0")),
        addr=env["MASTER_ADDR"],
        port=int(env["MASTER_PORT"]),
    )


def rank_device(device, local_rank: int) -> torch.device:
    """Rank r of a node uses the r-th GPU after the one asked for ('cuda' = 'cuda:0'); CPU ranks share."""
    device = torch.device(device)
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + local_rank)


def default_threads(world: int) -> int:
    """CPU threads per rank: the usable cores shared out (ranks on one node compete for them)."""
    return max(1, default_num_threads() // world)


def _store(addr: str, port: int, world: int, *, master: bool, timeout: float) -> dist.TCPStore:
    return dist.TCPStore(addr, port, world, is_master=master, timeout=seconds(timeout), wait_for_workers=False)


def describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "is running"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


# -- the workers ---------------------------------------------------------------------------------------


def worker_main(
    rank: int,
    world: int,
    addr: str,
    port: int,
    source: ModelSource,
    device: str,
    timeout: float,
    startup_timeout: float,
    num_threads: int,
    spawned: bool = True,
) -> None:
    """A rank > 0, from spawn or torchrun: connect, load the shard, serve rank 0 until STOP."""
    if spawned:  # Ctrl-C in the terminal reaches the whole process group: rank 0 decides what happens
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(num_threads)
    base = _store(addr, port, world, master=False, timeout=startup_timeout)
    store = dist.PrefixStore("minisched", base)
    store.set(f"hello/{rank}", "1")
    group = TPGroup(
        rank,
        world,
        device,
        store=dist.PrefixStore("minisched/pg", base),
        timeout=timeout,
        startup_timeout=startup_timeout,
    )
    try:
        model = shard_model(source.load(), group, device=device)
    except Exception as exc:  # noqa: BLE001 -- reported to rank 0, which names it
        store.set(f"error/{rank}", f"{type(exc).__name__}: {exc}")
        sys.exit(1)
    store.set(f"ready/{rank}", "1")
    group.startup_barrier()
    try:
        worker_loop(group, model)
    except Exception as exc:  # noqa: BLE001 -- a failed collective: rank 0 reports the failure
        report_worker_error(rank, exc)
        os._exit(1)  # do not wait on a broken group at exit
    group.close()


def run_torchrun_worker(
    source: ModelSource,
    device: str = "cpu",
    *,
    timeout: float = DEFAULT_TIMEOUT,
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
    num_threads: Optional[int] = None,
) -> int:
    """The ranks > 0 of a torchrun launch: the same command line, but no engine."""
    env = torchrun_env()
    if env is None or env["rank"] == 0:
        raise RuntimeError("run_torchrun_worker is for the ranks > 0 of a torchrun launch")
    worker_main(
        env["rank"],
        env["world"],
        env["addr"],
        env["port"],
        source,
        str(rank_device(device, env["local_rank"])),
        timeout,
        startup_timeout,
        num_threads or default_threads(int(os.environ.get("LOCAL_WORLD_SIZE", env["world"]))),
        spawned=False,
    )
    return 0


# -- rank 0 --------------------------------------------------------------------------------------------


class TPSession:
    """Rank 0's handle on the group: the workers, its own shard, heartbeats and failure detection."""

    def __init__(
        self,
        world: int,
        source: ModelSource,
        device: torch.device,
        timeout: float,
        startup_timeout: float,
        num_threads: int,
    ):
        self.world, self.source, self.device = world, source, device
        self.timeout, self.startup_timeout, self.num_threads = timeout, startup_timeout, num_threads
        self.procs: list = []  # spawned workers (one node); empty under torchrun
        self.store: Optional[dist.PrefixStore] = None
        self.group: Optional[TPGroup] = None
        self.model: Optional[LlamaModel] = None
        self.kv_cache: Optional[torch.Tensor] = None  # the newest engine's pool (the workers hold one like it)
        self.failure: Optional[str] = None
        self.closed = False
        self.last_activity = time.monotonic()
        self.heartbeat = min(30.0, max(0.5, timeout / 4))
        self._stop = threading.Event()
        self._fail_lock = threading.Lock()  # the engine thread and the monitor may both see a failure
        self._monitor: Optional[threading.Thread] = None

    @classmethod
    def start(
        cls,
        world: int,
        source: ModelSource,
        *,
        device="cpu",
        timeout: float = DEFAULT_TIMEOUT,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
        num_threads: Optional[int] = None,
    ) -> TPSession:
        """Validate, start (or join) the workers, load this rank's shard; returns when every rank is ready."""
        check_tp(source.model_config(), world)
        if world < 2:
            raise ValueError("a tensor-parallel session needs at least 2 ranks (--tp 1 is the plain engine)")
        if not timeout > 0 or not startup_timeout > 0:
            raise ValueError("the tensor-parallel timeouts must be > 0 seconds")
        env = torchrun_env()
        if env is not None and env["world"] != world:
            raise ValueError(f"torchrun started {env['world']} processes but --tp is {world}")
        if env is not None and env["rank"] != 0:
            raise ValueError("TPSession.start runs on rank 0; the other ranks run run_torchrun_worker")
        local = rank_device(device, 0 if env is None else env["local_rank"])
        if local.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' requested but no CUDA device is available")
        if env is None and local.type == "cuda" and local.index + world > torch.cuda.device_count():
            raise ValueError(
                f"--tp {world} on {device} needs GPUs {local.index}..{local.index + world - 1} (one per "
                f"rank; NCCL cannot share one), but this machine has {torch.cuda.device_count()}"
            )
        threads = num_threads or default_threads(
            world if env is None else int(os.environ.get("LOCAL_WORLD_SIZE", world))
        )
        self = cls(world, source, local, timeout, startup_timeout, threads)  # noqa: PLW0642 -- the new session
        torch.set_num_threads(threads)
        try:
            if env is None:
                base = _store("127.0.0.1", 0, world, master=True, timeout=startup_timeout)
                ctx = torch.multiprocessing.get_context("spawn")
                for r in range(1, world):
                    p = ctx.Process(
                        target=worker_main,
                        name=f"minisched-tp{r}",
                        daemon=True,
                        args=(
                            r,
                            world,
                            "127.0.0.1",
                            base.port,
                            source,
                            str(rank_device(device, r)),
                            timeout,
                            startup_timeout,
                            threads,
                        ),
                    )
                    p.start()
                    self.procs.append(p)
            else:
                master = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"
                base = _store(env["addr"], env["port"], world, master=master, timeout=startup_timeout)
            self.store = dist.PrefixStore("minisched", base)
            self._await("hello")
            self.group = TPGroup(
                0,
                world,
                local,
                store=dist.PrefixStore("minisched/pg", base),
                timeout=timeout,
                startup_timeout=startup_timeout,
            )
            self.model = shard_model(source.load(), self.group, device=local)
            self._await("ready")
            self.group.startup_barrier()  # the workers wait here for rank 0, then for steps (bounded by heartbeats)
        except BaseException:
            self._kill_workers()
            raise
        self.last_activity = time.monotonic()
        self._monitor = threading.Thread(target=self._watch, name="minisched-tp-monitor", daemon=True)
        self._monitor.start()
        return self

    def _await(self, stage: str) -> None:
        """Wait until every worker has posted `stage`, watching for errors and dead processes."""
        store = self.store
        if store is None:
            raise TPError("the tensor-parallel session has no store yet")
        deadline = time.monotonic() + self.startup_timeout
        pending = set(range(1, self.world))
        while pending:
            for r in sorted(pending):
                if store.check([f"error/{r}"]):
                    raise TPError(
                        f"tensor-parallel rank {r} failed to start: {store.get(f'error/{r}').decode(errors='replace')}"
                    )
                if store.check([f"{stage}/{r}"]):
                    pending.discard(r)
            dead = self._dead_worker()
            if dead:
                raise TPError(f"tensor-parallel {dead} while starting")
            if pending and time.monotonic() > deadline:
                raise TPError(f"tensor-parallel ranks {sorted(pending)} not {stage} within {self.startup_timeout:g} s")
            time.sleep(0.05)

    # -- engines -------------------------------------------------------------------------------------
    def attach(self, kv_cache: torch.Tensor, page_size: int, backend: str, check: bool) -> None:
        """A new engine's KV pool: every worker replaces its own by one of the same shape (earlier engines
        of the session stop working: the workers' pool belongs to the newest)."""
        from minisched import ops

        h = protocol.header(
            protocol.SETUP,
            kv_cache.shape[2],  # [L, 2, num_pages, page_size, Hkv, D]
            page_size,
            ops.BACKENDS.index(backend),
            int(check),
            device=self.device,
        )
        group = self._step_group()
        with group.lock:
            self._usable(None)
            self._send(lambda: group.broadcast(h))
            self.kv_cache = kv_cache

    def health(self) -> Optional[str]:
        """None while the ranks can run steps, else why not."""
        return self.failure

    def run_step(
        self, kv_cache: torch.Tensor, input_ids: torch.Tensor, meta, *, backend: str, check: bool
    ) -> torch.Tensor:
        """One forward on every rank: header and payload to the workers, then this rank's shard."""
        group = self._step_group()
        with group.lock:
            self._usable(kv_cache)
            h, payload = protocol.pack_step(input_ids, meta)  # before sending: a failure here leaves all in step

            def step():
                group.broadcast(h)
                group.broadcast(payload)
                return self.model(input_ids, meta, kv_cache, backend=backend, check=check)

            return self._send(step)

    def _step_group(self) -> TPGroup:
        if self.group is None:
            raise TPError("the tensor-parallel session is not started")
        return self.group

    def _usable(self, kv_cache: Optional[torch.Tensor]) -> None:
        if self.failure is not None:
            raise TPError(self.failure)
        if self.closed:
            raise TPError("the tensor-parallel session is closed")
        if kv_cache is not None and kv_cache is not self.kv_cache:
            raise TPError("this engine's KV pool on the other ranks was replaced by a newer engine of the session")

    def _send(self, fn):
        """Run an exchange with the workers; any failure inside breaks the session for good (the ranks
        may be out of step: half a step sent, a collective missing)."""
        try:
            out = fn()
        except Exception as exc:
            raise self._fail(exc) from exc
        except BaseException as exc:  # Ctrl-C mid-step: the session is broken, the interrupt goes on
            self._fail(exc)
            raise
        self.last_activity = time.monotonic()
        return out

    def _fail(self, exc: Optional[BaseException] = None, dead: Optional[str] = None) -> TPError:
        with self._fail_lock:
            if self.failure is None:
                self._record_failure(exc, dead)
        return TPError(self.failure)

    def _record_failure(self, exc: Optional[BaseException], dead: Optional[str]) -> None:
        if dead is None and self.procs:  # name a dead worker if there is one: the likeliest cause
            for _ in range(20):
                dead = self._dead_worker()
                if dead:
                    break
                time.sleep(0.05)
        if dead is not None:
            why = dead
        elif exc is not None and "timed out" in str(exc).lower():
            why = (
                f"a collective did not complete within {self.timeout:g} s (a rank hangs or is overloaded; "
                f"--tp-timeout sets the limit): {str(exc).splitlines()[0]}"
            )
        else:
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if exc is not None and str(exc) else ''}"
        self.failure = f"tensor parallelism failed: {why}"
        self._kill_workers()

    # -- watching ------------------------------------------------------------------------------------
    def _dead_worker(self) -> Optional[str]:
        for r, p in enumerate(self.procs, 1):
            if p.exitcode is not None:
                return f"worker rank {r} (pid {p.pid}) {describe_exit(p.exitcode)}"
        return None

    def _watch(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        group = self._step_group()
        while not self._stop.wait(0.2):
            if self.failure is not None or self.closed:
                return
            dead = self._dead_worker()
            if dead:
                self._fail(dead=dead)
                return
            if time.monotonic() - self.last_activity >= self.heartbeat and group.lock.acquire(blocking=False):
                try:
                    if self.failure is None and not self.closed:
                        self._send(lambda: group.broadcast(protocol.header(protocol.NOOP, device=self.device)))
                except TPError:
                    return
                finally:
                    group.lock.release()

    def _kill_workers(self) -> None:
        for p in self.procs:
            if p.exitcode is None:
                p.kill()
        for p in self.procs:
            p.join(timeout=5)

    # -- stopping ------------------------------------------------------------------------------------
    def close(self, timeout: float = 10.0) -> None:
        """STOP to the workers and wait for them (idempotent). After a failure: just kill them."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        if self.failure is None and self.group is not None and self.group.lock.acquire(timeout=timeout):
            try:
                self.group.broadcast(protocol.header(protocol.STOP, device=self.device))
                for p in self.procs:
                    p.join(timeout=timeout)
                self.group.close()
            except Exception:  # noqa: BLE001 -- leaving anyway; the workers are killed below
                pass
            finally:
                self.group.lock.release()
        self._kill_workers()
        if self.failure is not None and self.group is not None and self.group.backend == "gloo":
            try:  # the peers are gone: leaving a gloo group only closes sockets (this process may start another)
                self.group.close()
            except Exception:  # noqa: BLE001
                pass
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=1)

    def __enter__(self) -> TPSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
