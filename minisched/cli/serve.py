"""`minisched serve`: the OpenAI-compatible HTTP server (docs/serving.md).

minisched serve [engine options] [--host HOST] [--port PORT] [--api-key KEY]
                [--max-queued-requests N] [--served-model-name NAME] [--grace-period S]
                [--max-request-body-bytes B] [--max-choices-per-request N] [--max-grammar-bytes B] ...
                [--dp N] [--router cache-aware|round-robin] [--engine-heartbeat-timeout S] ...
                [--record PATH] [--record-max-bytes B] [--record-keep N] [--record-interval S]

Every option is a field of `ServeConfig` below (or of the config it holds: serve/limits.py's ServerLimits,
serve/router.py's RouterConfig, serve/pool.py's Supervision, observe/record_series.py's RecordOptions), its
default and help written there once (base/flags.py).

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
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

from minisched.base.flags import add_flags, flag, flag_names, from_flags, name_fields, section
from minisched.cli.common import CLIError, check_output_path, engine_args, engine_config, make_engine
from minisched.observe.record_series import RecordOptions
from minisched.serve.limits import ServerLimits
from minisched.serve.pool import Supervision
from minisched.serve.router import RouterConfig

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class ServeConfig:
    """`minisched serve`'s options besides the engine's (EngineConfig): each field is its flag, the bounds,
    routing, supervision and recording are their owners' configs (base/flags.py `section`), validated there."""

    host: str = flag("127.0.0.1", "bind address (default: loopback only)")
    port: int = flag(30000)
    api_key: Optional[str] = flag(
        None,
        "require 'Authorization: Bearer KEY' on /v1 routes (default: $MINISCHED_API_KEY)",
        type=str,
        env="MINISCHED_API_KEY",
    )
    limits: ServerLimits = section(ServerLimits, "request bounds (each a 4xx naming its option; docs/serving.md)")
    served_model_name: Optional[str] = flag(None, "the model id clients send (default: --model)", type=str)
    grace_period: float = flag(
        30.0, "seconds in-flight requests may finish after SIGTERM / Ctrl-C before they are aborted"
    )
    log_level: str = flag("info", choices=LOG_LEVELS)
    dp: int = flag(
        1,
        "engine replicas, each its own process with its own KV pool and radix cache",
        group="data parallelism",
    )
    router: RouterConfig = section(RouterConfig, "data parallelism", prefix="router_")
    engine_in_process: bool = flag(
        False,
        "run the engine on a thread of the server process (no isolation, no restarts)",
        group="engine processes",
    )
    supervision: Supervision = section(Supervision, "engine processes", prefix="engine_")
    recording: RecordOptions = section(
        RecordOptions,
        "recording (minisched explain / minisched replay read the files; docs/lifecycle.md)",
        prefix="record_",
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.grace_period < 0:
            raise ValueError(f"grace_period must be >= 0, got {self.grace_period}")
        if self.dp < 1:
            raise ValueError(f"dp must be >= 1, got {self.dp}")
        if self.engine_in_process and self.dp > 1:
            raise ValueError("engine_in_process runs one engine: not with dp")


def add_parser(sub) -> argparse.ArgumentParser:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    add_flags(s, ServeConfig())
    engine_args(s)
    return s


def serve_config(args) -> ServeConfig:
    """The ServeConfig of `minisched serve`'s options; a bad value is a one-line error naming its flag."""
    try:
        return from_flags(ServeConfig, args)
    except ValueError as exc:
        raise CLIError(name_fields(str(exc), flag_names(ServeConfig))) from exc


def cmd_serve(args) -> int:
    cfg = serve_config(args)
    if cfg.dp > 1 and getattr(args, "tp", 1) > 1:  # a replica is a daemon process: it cannot spawn TP workers
        raise CLIError("--dp with --tp is not supported yet: use one of them")
    recording = _record_options(cfg.recording)
    from minisched.serve import create_app, make_server
    from minisched.serve.request_id import install_logging

    install_logging(cfg.log_level)  # the request id on every line
    name = cfg.served_model_name or args.model or "smollm2"
    config = engine_config(args)
    in_process = None
    if cfg.engine_in_process or config.tp > 1:
        from minisched.observe.record_series import SeriesRecorder
        from minisched.serve import EngineLoop

        engine, loop = make_engine(config), None
        in_process = EngineLoop(engine, recorder=None if recording is None else SeriesRecorder(recording))
    else:
        engine, loop = _start_pool(cfg, config, recording)
    app = create_app(engine, model_name=name, api_key=cfg.api_key, engine_loop=loop or in_process, limits=cfg.limits)
    print(
        f"minisched serve: model {name!r} on http://{cfg.host}:{cfg.port}/v1 "
        f"(context {engine.sched_config.max_context_len} tokens, {engine.sched_config.num_pages} KV pages"
        f"{f' per replica, {cfg.dp} replicas, {cfg.router.policy} routing' if cfg.dp > 1 else ''}"
        f"{', API key required' if cfg.api_key else ''})",
        flush=True,
    )
    if recording is not None:
        print(f"minisched serve: recording to {_series_pattern(recording)}", flush=True)
    server = make_server(app, cfg.host, cfg.port, cfg.grace_period, cfg.log_level)
    failure: list[str] = []
    if config.tp > 1:
        threading.Thread(target=_end_on_tp_failure, args=(engine, server, failure), daemon=True).start()
    try:
        server.run()
    except OSError as exc:  # e.g. the port is taken
        raise CLIError(f"cannot serve on {cfg.host}:{cfg.port}: {exc}") from exc
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


def _record_options(options: RecordOptions) -> Optional[RecordOptions]:
    """--record's options, or None without a path; a path that cannot be written is a one-line error now."""
    if options.path is None:
        return None
    check_output_path(options.path, "--record")
    return options


def _series_pattern(options) -> str:
    folder, stem, suffix = options.base
    return str(folder / f"{stem}.r<replica>.<start>.p<pid>.<segment>{suffix}")


def _start_pool(cfg: ServeConfig, config, recording=None):
    """The engine processes (`--dp N`: N) behind this server (minisched/serve/pool.py); returns (EngineInfo, pool)."""
    from minisched.serve.pool import EnginePool
    from minisched.serve.replica import ReplicaStartError

    factories = [functools.partial(make_engine, replica_config(config, i)) for i in range(cfg.dp)]
    print(f"minisched serve: starting {cfg.dp} engine process{'es' if cfg.dp > 1 else ''} ...", flush=True)
    try:
        pool = EnginePool(factories, cfg.router, supervision=cfg.supervision, recorder=_recorder(recording)).start()
    except ReplicaStartError as exc:
        raise CLIError(str(exc)) from exc
    return pool.info, pool


def _recorder(options):
    """What each engine process calls with its replica index to build its Recorder (picklable), or None."""
    if options is None:
        return None
    from minisched.observe.record_series import SeriesRecorder

    return functools.partial(SeriesRecorder, options)
