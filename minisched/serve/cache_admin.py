"""Emptying an engine's prefix cache (POST /flush_cache, sglang-router's `/flush_cache` fan-out).

`flush_engine_cache(engine)` runs on the engine's own thread (`ServingLoop.flush_cache` sends it
there: once per replica with --dp N) and goes through the scheduler's public `flush_cache()`.
"""

from __future__ import annotations


def flush_engine_cache(engine) -> int:
    """Drop every unlocked node of the radix cache, on the device and in the host tier (pages that live
    requests hold stay, as SGLang's flush keeps what is running); returns the device pages freed."""
    return engine.scheduler.flush_cache().device_pages
