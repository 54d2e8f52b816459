"""The OpenAI-compatible HTTP server (docs/serving.md).

    from minisched.serve import create_app, run
    run(create_app(Engine("smollm2"), model_name="smollm2"), port=30000)

Files: protocol (OpenAI request/response/error bodies), engine_loop (the engine on its own
thread), state (the HTTP side's per-request state, admission, drain), detokenize (incremental
text with stop strings held back), metrics (Prometheus), app (FastAPI routes), server
(uvicorn with a graceful drain), limits and request_body (the bounds on one request).
"""

from minisched.serve.app import create_app
from minisched.serve.engine_loop import EngineLoop
from minisched.serve.server import make_server, run

__all__ = ["EngineLoop", "create_app", "make_server", "run"]
