"""A tiny random-weights Llama, byte-level engines on it, and its greedy reference (dense recompute)."""

from __future__ import annotations

import functools

import torch

from minisched.engine import Engine
from minisched.model import weights
from minisched.model.config import preset
from minisched.model.llama import LlamaModel, dense_forward
from minisched.model.tokenizer import MiniTokenizer


@functools.cache
def tiny_model(seed: int = 0) -> LlamaModel:
    """The `tiny` preset with random weights (shared: tests must not change its weights)."""
    cfg, state = weights.dummy_weights(preset("tiny"), seed=seed)
    return LlamaModel.from_state_dict(cfg, state)


def byte_engine(model: LlamaModel, **options) -> Engine:
    """A random-weights model has no tokenizer of its own: byte-level, explicitly."""
    return Engine(model, tokenizer=MiniTokenizer.byte_level(model.cfg.vocab_size), **options)


_REF_CACHE: dict = {}


def reference(model: LlamaModel, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by full recompute with dense attention (no pool, no cache)."""
    key = (id(model), tuple(prompt), n)
    if key not in _REF_CACHE:
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(dense_forward(model, torch.tensor(ids))[-1].argmax()))
        _REF_CACHE[key] = ids[len(prompt) :]
    return _REF_CACHE[key]


def prompts(lengths, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


def assert_pool_whole(engine: Engine) -> None:
    """No live request, no batch in flight, and every page is free once the cache is evicted."""
    sched = engine.scheduler
    assert sched.snapshot().live == 0 and not sched.has_work()
    sched.check_invariants()
    sched.flush_cache()
    snap = sched.snapshot()
    assert snap.pages_free == snap.pages_total == sched.config.num_pages
