"""`minisched serve`: the OpenAI-compatible HTTP server (docs/serving.md).

    minisched serve [engine options] [--host 127.0.0.1] [--port 30000] [--api-key KEY]
                    [--max-queued-requests 512] [--served-model-name NAME] [--grace-period 30]
"""
from __future__ import annotations

import argparse
import logging
import os

from minisched.cli.common import CLIError, engine_args, make_engine


def add_parser(sub) -> argparse.ArgumentParser:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    s.add_argument("--port", type=int, default=30000)
    s.add_argument("--api-key", default=os.environ.get("MINISCHED_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $MINISCHED_API_KEY)")
    s.add_argument("--max-queued-requests", type=int, default=512,
                   help="requests waiting for their first token beyond this get 429 + Retry-After")
    s.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    s.add_argument("--grace-period", type=float, default=30.0,
                   help="seconds in-flight requests may finish after SIGTERM / Ctrl-C before they are aborted")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    engine_args(s)
    return s


def cmd_serve(args) -> int:
    if not 0 <= args.port <= 65535:
        raise CLIError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_queued_requests < 0:
        raise CLIError("--max-queued-requests must be >= 0")
    if args.grace_period < 0:
        raise CLIError("--grace-period must be >= 0")
    from minisched.serve import create_app, run

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    engine = make_engine(args)
    name = args.served_model_name or args.model or "smollm2"
    app = create_app(engine, model_name=name, api_key=args.api_key, max_queued_requests=args.max_queued_requests)
    print(f"minisched serve: model {name!r} on http://{args.host}:{args.port}/v1 "
          f"(context {engine.sched_config.max_context_len} tokens, {engine.sched_config.num_pages} KV pages"
          f"{', API key required' if args.api_key else ''})", flush=True)
    try:
        run(app, host=args.host, port=args.port, grace_period=args.grace_period, log_level=args.log_level)
    except OSError as exc:  # e.g. the port is taken
        raise CLIError(f"cannot serve on {args.host}:{args.port}: {exc}") from exc
    return 0
