"""`minisched serve`: the OpenAI-compatible HTTP server (docs/serving.md).

minisched serve [engine options] [--host 127.0.0.1] [--port 30000] [--api-key KEY]
                [--max-queued-requests 512] [--served-model-name NAME] [--grace-period 30]
                [--max-request-body-bytes 33554432] [--max-choices-per-request 256] [--max-grammar-bytes 65536] ...
                [--dp N] [--router cache-aware|round-robin] [--engine-heartbeat-timeout 10] ...
                [--record PATH] [--record-max-bytes 16777216] [--record-keep 8] [--record-interval 10]

The engine runs in a process of its own (N with --dp N), supervised: a dead or hung one is
restarted (minisched/serve/pool.py). `--engine-in-process` keeps the engine on a thread of the
server process instead (the layout before; for comparison); `--tp N` does so too (the engine's
rank 0 spawns and watches its ranks itself, or joins torchrun's: docs/fleet.md); a lost rank ends the
server with that error (exit status 1). `--record PATH` writes each engine process's scheduler records
as a rotating series of run files that `minisched explain` and `minisched replay` read
(minisched/observe/record_series.py).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import threading
import time

from minisched.cli.common import CLIError, check_output_path, engine_args, engine_config, make_engine

# observe/record_series.py's RecordOptions holds these defaults (not imported here: `minisched` starts fast)
RECORD_MAX_BYTES = 16 * 2**20
RECORD_KEEP = 8
RECORD_INTERVAL = 10.0


def add_parser(sub) -> argparse.ArgumentParser:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    s.add_argument("--port", type=int, default=30000)
    s.add_argument(
        "--api-key",
        default=os.environ.get("MINISCHED_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $MINISCHED_API_KEY)",
    )
    s.add_argument(
        "--max-queued-requests",
        type=int,
        default=512,
        help="requests waiting for their first token beyond this get 429 + Retry-After",
    )
    # serve/limits.py's ServerLimits holds the defaults (not imported here: `minisched` starts fast)
    lim = s.add_argument_group("request bounds (each a 4xx naming its option; docs/serving.md)")
    for flag, what in (
        ("--max-request-body-bytes", "bytes of a request body, larger: 413 (default 32 MiB)"),
        ("--max-choices-per-request", "prompts x n of one request: each is a request in the engine (default 256)"),
        ("--max-stop-chars", "characters of one stop string (default 256)"),
        ("--max-logit-bias", "logit_bias entries (default 1024)"),
        ("--max-messages", "messages of one chat request (default 4096)"),
        ("--max-grammar-bytes", "bytes of a json_schema, regex or ebnf (default 64 KiB)"),
    ):
        lim.add_argument(flag, type=int, default=argparse.SUPPRESS, help=what)
    s.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    s.add_argument(
        "--grace-period",
        type=float,
        default=30.0,
        help="seconds in-flight requests may finish after SIGTERM / Ctrl-C before they are aborted",
    )
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    dp = s.add_argument_group("data parallelism")
    dp.add_argument(
        "--dp", type=int, default=1, help="engine replicas, each its own process with its own KV pool and radix cache"
    )
    dp.add_argument(
        "--router",
        default="cache-aware",
        choices=["cache-aware", "round-robin"],
        help="how --dp routes a request: to the replica caching its longest prefix, or in turn",
    )
    dp.add_argument(
        "--router-cache-threshold",
        type=float,
        default=0.5,
        help="cache-aware: the prefix match (share of the prompt) above which it wins over a fresh replica",
    )
    dp.add_argument(
        "--router-balance-abs-threshold",
        type=int,
        default=32,
        help="cache-aware: route by load when max - min in-flight requests exceeds this ...",
    )
    dp.add_argument(
        "--router-balance-rel-threshold", type=float, default=1.1, help="... and max exceeds this times min"
    )
    sup = s.add_argument_group("engine processes")
    sup.add_argument(
        "--engine-in-process",
        action="store_true",
        help="run the engine on a thread of the server process (no isolation, no restarts)",
    )
    sup.add_argument(
        "--engine-heartbeat-timeout",
        type=float,
        default=10.0,
        help="seconds without a heartbeat (sent every 0.5 s) before an engine process counts as hung",
    )
    sup.add_argument(
        "--engine-step-timeout",
        type=float,
        default=300.0,
        help="seconds one engine step may run before the process counts as hung",
    )
    sup.add_argument(
        "--engine-max-restarts",
        type=int,
        default=5,
        help="restarts of an engine process within 10 minutes before it is given up (0: never restart)",
    )
    rec = s.add_argument_group("recording (minisched explain / minisched replay read the files; docs/lifecycle.md)")
    rec.add_argument(
        "--record",
        default=None,
        metavar="PATH",
        help="write each engine process's scheduler journal and events to PATH's series of run files: "
        "runs/serve.json -> runs/serve.r<replica>.<start>.p<pid>.<segment>.json",
    )
    rec.add_argument(
        "--record-max-bytes",
        type=int,
        default=RECORD_MAX_BYTES,
        help="bytes of one record file (16 MiB); past them the next file starts",
    )
    rec.add_argument(
        "--record-keep", type=int, default=RECORD_KEEP, help="record files kept per replica, the oldest deleted"
    )
    rec.add_argument(
        "--record-interval",
        type=float,
        default=RECORD_INTERVAL,
        help="seconds between writes of what is new (the files lag the engine by about this much)",
    )
    engine_args(s)
    return s


def cmd_serve(args) -> int:
    if not 0 <= args.port <= 65535:
        raise CLIError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_queued_requests < 0:
        raise CLIError("--max-queued-requests must be >= 0")
    if args.grace_period < 0:
        raise CLIError("--grace-period must be >= 0")
    if args.dp < 1:
        raise CLIError(f"--dp must be >= 1, got {args.dp}")
    if args.dp > 1 and getattr(args, "tp", 1) > 1:  # a replica is a daemon process: it cannot spawn TP workers
        raise CLIError("--dp with --tp is not supported yet: use one of them")
    if args.engine_in_process and args.dp > 1:
        raise CLIError("--engine-in-process runs one engine: not with --dp")
    recording = _record_options(args)
    from minisched.serve import create_app, make_server
    from minisched.serve.limits import ServerLimits
    from minisched.serve.request_id import install_logging

    try:
        limits = ServerLimits(**{f: v for f, v in vars(args).items() if f in vars(ServerLimits())})
    except ValueError as exc:
        raise CLIError(f"--{str(exc).replace('_', '-')}") from exc
    if limits.max_choices_per_request > max(1, args.max_queued_requests):
        raise CLIError("--max-choices-per-request must be <= --max-queued-requests (the queue counts choices)")

    install_logging(args.log_level)  # the request id on every line
    name = args.served_model_name or args.model or "smollm2"
    config = engine_config(args)
    in_process = None
    if args.engine_in_process or config.tp > 1:
        from minisched.observe.record_series import SeriesRecorder
        from minisched.serve import EngineLoop

        engine, loop = make_engine(config), None
        in_process = EngineLoop(engine, recorder=None if recording is None else SeriesRecorder(recording))
    else:
        engine, loop = _start_pool(args, config, recording)
    app = create_app(
        engine,
        model_name=name,
        api_key=args.api_key,
        max_queued_requests=args.max_queued_requests,
        engine_loop=loop or in_process,
        limits=limits,
    )
    print(
        f"minisched serve: model {name!r} on http://{args.host}:{args.port}/v1 "
        f"(context {engine.sched_config.max_context_len} tokens, {engine.sched_config.num_pages} KV pages"
        f"{f' per replica, {args.dp} replicas, {args.router} routing' if args.dp > 1 else ''}"
        f"{', API key required' if args.api_key else ''})",
        flush=True,
    )
    if recording is not None:
        print(f"minisched serve: recording to {_series_pattern(recording)}", flush=True)
    server = make_server(app, args.host, args.port, args.grace_period, args.log_level)
    failure: list[str] = []
    if config.tp > 1:
        threading.Thread(target=_end_on_tp_failure, args=(engine, server, failure), daemon=True).start()
    try:
        server.run()
    except OSError as exc:  # e.g. the port is taken
        raise CLIError(f"cannot serve on {args.host}:{args.port}: {exc}") from exc
    finally:
        if loop is not None:  # the replicas end with the server, however it ends
            loop.stop()
            loop.join(10)
    return 1 if failure else 0


def _end_on_tp_failure(engine, server, failure: list[str]) -> None:
    """--tp: once a rank is lost (its node gone, a collective hung) the engine can only fail requests;
    the server says why and ends (exit status 1), so a supervisor or torchrun sees it, instead of
    answering 503 for ever."""
    while not server.should_exit:
        why = engine.health()
        if why:
            failure.append(why)
            print(f"minisched serve: error: {why}; shutting down", file=sys.stderr, flush=True)
            server.should_exit = True  # the usual drain: requests in flight end with that error
            return
        time.sleep(0.5)


def replica_config(config, index: int):
    """Replica `index`'s engine config: on CUDA, one device per replica (cuda:0, cuda:1, ...)."""
    if not config.device.startswith("cuda"):
        return config
    base = int(config.device.split(":")[1]) if ":" in config.device else 0
    return config.with_options(device=f"cuda:{base + index}")


def _record_options(args):
    """--record's RecordOptions, or None; a path that cannot be written is a one-line error now, not later."""
    if args.record is None:
        return None
    check_output_path(args.record, "--record")
    from minisched.observe.record_series import RecordOptions

    try:
        return RecordOptions(
            args.record, max_bytes=args.record_max_bytes, keep=args.record_keep, interval=args.record_interval
        )
    except ValueError as exc:
        raise CLIError("--" + str(exc).replace("_", "-")) from exc


def _series_pattern(options) -> str:
    folder, stem, suffix = options.base
    return str(folder / f"{stem}.r<replica>.<start>.p<pid>.<segment>{suffix}")


def _start_pool(args, config, recording=None):
    """The engine processes (`--dp N`: N) behind this server (minisched/serve/pool.py); returns (EngineInfo, pool)."""
    from minisched.serve.pool import EnginePool, Supervision
    from minisched.serve.replica import ReplicaStartError
    from minisched.serve.router import RouterConfig

    try:
        supervision = Supervision(
            heartbeat_timeout=args.engine_heartbeat_timeout,
            step_timeout=args.engine_step_timeout,
            max_restarts=args.engine_max_restarts,
        )
    except ValueError as exc:
        raise CLIError(f"--engine-*: {exc}") from exc

    try:
        router = RouterConfig(
            args.router,
            cache_threshold=args.router_cache_threshold,
            balance_abs_threshold=args.router_balance_abs_threshold,
            balance_rel_threshold=args.router_balance_rel_threshold,
        )
    except ValueError as exc:
        raise CLIError(f"--router: {exc}") from exc
    factories = [functools.partial(make_engine, replica_config(config, i)) for i in range(args.dp)]
    print(f"minisched serve: starting {args.dp} engine process{'es' if args.dp > 1 else ''} ...", flush=True)
    try:
        pool = EnginePool(factories, router, supervision=supervision, recorder=_recorder(recording)).start()
    except ReplicaStartError as exc:
        raise CLIError(str(exc)) from exc
    return pool.info, pool


def _recorder(options):
    """What each engine process calls with its replica index to build its Recorder (picklable), or None."""
    if options is None:
        return None
    from minisched.observe.record_series import SeriesRecorder

    return functools.partial(SeriesRecorder, options)
