"""Emptying an engine's prefix cache (POST /flush_cache, sglang-router's `/flush_cache` fan-out).

`flush_engine_cache(engine)` runs on the engine's own thread (`ServingLoop.flush_cache` sends it
there: once per replica with --dp N). It is the one place that reaches into the scheduler for this;
the scheduler's own `flush_cache()` (device radix cache and host tier) replaces its body when it lands.
"""

from __future__ import annotations


def flush_engine_cache(engine) -> int:
    """Evict every unlocked page of the radix cache (pages that live requests hold stay, as
    SGLang's flush keeps what is running); returns the device pages freed."""
    sched = engine.scheduler
    pages = sched.tree.evict(sched.tree.total_pages)
    sched.pool.free(pages)
    return len(pages)
