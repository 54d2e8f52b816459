"""The OpenAI-compatible HTTP server (docs/serving.md).

    from minisched.serve import create_app, run
    run(create_app(Engine("smollm2"), model_name="smollm2"), port=30000)

Files: protocol (OpenAI request/response/error bodies), sglang_protocol (SGLang's /generate body), entry
(one body -> SamplingParams path for every route, each surface's defaults, the bounds checked), completions,
chat, generate, sglang_api (the routes), state (the HTTP side's per-request state, admission, drain),
responses (what the routes share: collecting, server-sent events, usage), app (FastAPI), server (uvicorn
with a graceful drain), limits (the bounds: options) and request_body (a body's bytes), errors, request_id,
metrics (Prometheus), debug; engine_loop (the engine on a thread), loop (the serving-loop protocol),
replica and pool (engine processes, `--dp N`), router (cache-aware routing), recorder, messages.

The names below load on first use: `minisched`'s command line reads the option configs (limits.py,
router.py, pool.py) without importing FastAPI and uvicorn.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from minisched.serve.app import create_app
    from minisched.serve.engine_loop import EngineLoop
    from minisched.serve.server import make_server, run

_HOME = {"create_app": "app", "EngineLoop": "engine_loop", "make_server": "server", "run": "server"}
__all__ = ["EngineLoop", "create_app", "make_server", "run"]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
