"""Structured outputs with xgrammar: compile off the critical path, mask the logits before sampling.

- `GrammarCompiler.submit(grammar)` compiles a request's `Grammar` (JSON schema -- compact,
  without free whitespace --, any JSON, regex, EBNF) against the model's vocabulary in a compile
  process (grammar_worker.py; killed past `timeout`, the engine's `grammar_compile_timeout`) and returns a future. The request
  waits in the scheduler's queue with that future as its gate (`Req.gate`): it holds no
  admission slot and no page until the grammar is ready (SGLang's grammar queue); a grammar that
  fails to compile ends it with an error (the HTTP side already rejected what does not parse).
- `Matchers` (the runner's) keeps one `GrammarMatcher` per live request. On the forward worker,
  in step order: `masks(reqs)` fills the next-token bitmask of each constrained row (a bool
  [B, V] tensor for `sample`), and `accept(reqs, tokens)` advances the matchers by the sampled
  tokens. Because both run where the tokens are sampled, the mask of step N+1 always sees token
  N, also under overlap scheduling (where step N+1 is built before token N exists). A retracted
  request keeps its matcher (its output tokens stay accepted), so nothing is replayed.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import logging
import queue
import select
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import torch

from minisched.engine import grammar_worker
from minisched.sched.req import Req
from minisched.sched.sampling_params import Grammar

log = logging.getLogger("minisched.engine")


def _xgrammar():
    try:
        import xgrammar
    except ImportError as exc:
        raise RuntimeError(f"structured outputs need the xgrammar package: pip install xgrammar ({exc})") from exc
    return xgrammar


TIMEOUT_OPTION = "--grammar-compile-timeout"  # EngineConfig.grammar_compile_timeout, named in the error
COMPILE_TIME_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)  # seconds (/metrics histogram)
COMPILE_WORKERS = 2  # compile processes: one slow grammar leaves the other free for the rest
GRAMMAR_FAILED = "the grammar failed to compile"  # the start of such a request's error (serve: a 400)
_WORKER = Path(__file__).with_name("grammar_worker.py")


class GrammarTimeout(Exception):
    pass


class _Worker:
    """One compile process (grammar_worker.py), started with the tokenizer's info."""

    def __init__(self, info_json: str):
        self.proc = subprocess.Popen(
            [sys.executable, str(_WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        )
        grammar_worker.write_frame(self.proc.stdin, ("init", info_json))
        if grammar_worker.read_frame(self.proc.stdout) != ("ready",):
            raise RuntimeError(f"the grammar compile worker did not start (exit status {self.proc.wait()})")

    def compile(self, kind: str, spec: str, timeout: float) -> tuple[str, str]:
        grammar_worker.write_frame(self.proc.stdin, ("compile", kind, spec))
        out = self.proc.stdout
        if out is None:  # never: the worker is started with stdout=PIPE
            raise RuntimeError("the grammar compile worker has no stdout pipe")
        ready, _, _ = select.select([out], [], [], timeout)
        if not ready:
            raise GrammarTimeout(f"it did not compile within {timeout:g} s (the engine's {TIMEOUT_OPTION})")
        got = grammar_worker.read_frame(out)
        if got is None:
            raise RuntimeError(f"the compile worker died (exit status {self.proc.wait()})")
        return got

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


class GrammarCompiler:
    """Compiles in `workers` processes of their own (grammar_worker.py), each compile bounded by
    `timeout`: xgrammar's compile time grows faster than the grammar and a native call cannot be
    stopped, so a compile past its deadline is ended by killing its process (a new one starts for
    the next grammar) -- one huge grammar never holds the compiler for the others. Results are
    kept in a small LRU (the same schema, or json_object, is compiled once)."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_id: Optional[int],
        *,
        timeout: float = 10.0,  # EngineConfig.grammar_compile_timeout's default
        workers: int = COMPILE_WORKERS,
        cache_size: int = 64,
    ):
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, eos_token_id
        self.timeout, self.workers, self.cache_size = timeout, workers, cache_size
        self._info = None
        self._lock = threading.Lock()
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._started = 0  # workers alive or starting
        self._cache: collections.OrderedDict[tuple[str, str], object] = collections.OrderedDict()
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self.compiled = 0  # grammars compiled (cache hits not counted)
        self.timeouts = 0
        self.compile_seconds = 0.0
        # compiles that returned (compiled or refused by xgrammar) per COMPILE_TIME_BUCKETS bound, the last past them all
        self.compile_time_counts = [0] * (len(COMPILE_TIME_BUCKETS) + 1)

    def _tokenizer_info(self):
        with self._lock:
            if self._info is None:
                xgr = _xgrammar()
                vocab = [self.tokenizer.token_bytes(i) for i in range(self.vocab_size)]
                self._info = xgr.TokenizerInfo(
                    vocab,
                    xgr.VocabType.RAW,
                    vocab_size=self.vocab_size,
                    stop_token_ids=[] if self.eos is None else [self.eos],
                )
            return self._info

    def compile(self, grammar: Grammar):
        key = (grammar.kind, grammar.spec)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        info = self._tokenizer_info()
        self._top_up()
        worker = self._idle.get()  # at most `workers` compiles run (the pool's threads): one comes free
        t0 = time.monotonic()
        try:
            status, payload = worker.compile(grammar.kind, grammar.spec, self.timeout)
        except BaseException as exc:
            worker.kill()  # busy (timed out) or broken: never reused
            with self._lock:
                self._started -= 1
                self.timeouts += isinstance(exc, GrammarTimeout)
            self._top_up()  # its successor starts now, not when the next grammar comes
            raise
        self._idle.put(worker)
        took = time.monotonic() - t0
        with self._lock:
            self.compile_seconds += took
            self.compile_time_counts[bisect.bisect_left(COMPILE_TIME_BUCKETS, took)] += 1
        if status == "error":
            raise RuntimeError(payload)
        compiled = _xgrammar().CompiledGrammar.deserialize_json(payload, info)
        with self._lock:
            self.compiled += 1
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _top_up(self) -> None:
        """Start workers (in the background: importing xgrammar takes seconds) up to `workers`."""
        with self._lock:
            missing, self._started = self.workers - self._started, self.workers
        for _ in range(missing):
            threading.Thread(target=self._start_worker, name="minisched-grammar-start", daemon=True).start()

    def _start_worker(self) -> None:
        try:
            self._idle.put(_Worker(self._tokenizer_info().serialize_json()))
        except Exception:
            log.exception("a grammar compile worker did not start")
            with self._lock:
                self._started -= 1

    def idle_workers(self) -> int:
        """Compile workers started and free now (tests, warm-up)."""
        return self._idle.qsize()

    def submit(self, grammar: Grammar) -> concurrent.futures.Future:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix="minisched-grammar")
        return self._pool.submit(self.compile, grammar)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        while not self._idle.empty():
            self._idle.get().kill()


class Matchers:
    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._by_req: weakref.WeakKeyDictionary[Req, object] = weakref.WeakKeyDictionary()

    def _matcher(self, req: Req):
        m = self._by_req.get(req)
        if m is None:
            m = self._by_req[req] = _xgrammar().GrammarMatcher(req.gate.result())
        return m

    def masks(self, reqs: Sequence[Req]) -> Optional[torch.Tensor]:
        """bool [len(reqs), V]: the tokens each constrained request may sample next (others: all)."""
        rows = [i for i, r in enumerate(reqs) if r.sampling.grammar is not None]
        if not rows:
            return None
        xgr = _xgrammar()
        bitmask = xgr.allocate_token_bitmask(len(reqs), self.vocab_size)
        for i in rows:
            m = self._matcher(reqs[i])
            if not m.is_terminated():  # (terminated: its request ended; this token is dropped)
                m.fill_next_token_bitmask(bitmask, i)
        bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
        return bits.reshape(len(reqs), -1)[:, : self.vocab_size].bool()

    def accept(self, reqs: Sequence[Req], tokens: Sequence[int]) -> None:
        for r, t in zip(reqs, tokens):
            if r.sampling.grammar is not None:
                m = self._matcher(r)
                if not m.is_terminated() and not m.accept_token(int(t)):
                    raise RuntimeError(f"{r.rid}: the grammar rejected token {t} that its mask allowed")
