"""Structured outputs with xgrammar: compile off the critical path, mask the logits before sampling.

- `GrammarCompiler.submit(grammar)` compiles a request's `Grammar` (JSON schema -- compact,
  without free whitespace --, any JSON, regex, EBNF) against the model's vocabulary on a worker thread and returns a future. The request
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

import concurrent.futures
import threading
import weakref
from collections.abc import Sequence
from typing import Optional

import torch

from minisched.sched.req import Req
from minisched.sched.sampling_params import Grammar


def _xgrammar():
    try:
        import xgrammar
    except ImportError as exc:
        raise RuntimeError(f"structured outputs need the xgrammar package: pip install xgrammar ({exc})") from exc
    return xgrammar


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, eos_token_id: Optional[int]):
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, eos_token_id
        self._compiler = None
        self._lock = threading.Lock()
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None

    def _get(self):
        with self._lock:
            if self._compiler is None:
                xgr = _xgrammar()
                vocab = [self.tokenizer.token_bytes(i) for i in range(self.vocab_size)]
                info = xgr.TokenizerInfo(
                    vocab,
                    xgr.VocabType.RAW,
                    vocab_size=self.vocab_size,
                    stop_token_ids=[] if self.eos is None else [self.eos],
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)  # caches compiled grammars
            return self._compiler

    def compile(self, grammar: Grammar):
        c = self._get()
        if grammar.kind == "json_object":
            return c.compile_builtin_json_grammar()
        if grammar.kind == "json_schema":  # compact JSON: no free whitespace for a model to loop in
            return c.compile_json_schema(grammar.spec, any_whitespace=False)
        if grammar.kind == "regex":
            return c.compile_regex(grammar.spec)
        return c.compile_grammar(grammar.spec)

    def submit(self, grammar: Grammar) -> concurrent.futures.Future:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="minisched-grammar")
        return self._pool.submit(self.compile, grammar)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


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
