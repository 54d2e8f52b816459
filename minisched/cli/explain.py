"""`minisched explain RUN`: each request's story from a run file (`minisched bench --json`,
`generate --record`, `serve --record`): why it waited, how it was admitted, chunked, retracted and
decoded, with what each phase cost (minisched/observe/explain.py). Any one file of a `serve --record`
series is explained on its own."""

from __future__ import annotations

import argparse

from minisched.cli.common import CLIError, Formatter

ALL_LIMIT = 20  # without --request or --slowest, every request of a run up to this many


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "explain", help="why each request of a recorded run waited and how it ran", formatter_class=Formatter
    )
    p.add_argument("run", help="run file (bench --json, generate --record, serve --record)")
    p.add_argument(
        "--request",
        action="append",
        default=None,
        metavar="ID",
        help="this request's story (repeatable): its id, its call's id, or (serve --record) the client's X-Request-Id",
    )
    p.add_argument(
        "--slowest",
        type=int,
        default=None,
        metavar="K",
        help="the K requests with the worst TTFT (then those without one: a serve --record file's earlier arrivals)",
    )
    p.add_argument("--name", default=None, help="the run of the file to read (default: the first)")
    return p


def pick_run(path: str, name: str | None):
    """The named (or first) run of a run file; CLIError naming the problem."""
    from minisched.observe.run_record import load_runs

    try:
        runs = load_runs(path)
    except FileNotFoundError as exc:
        raise CLIError(f"{path}: no such file") from exc
    except (ValueError, KeyError, TypeError) as exc:  # not JSON, not a run file
        raise CLIError(f"{path}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc
    if not runs:
        raise CLIError(f"{path}: no runs")
    if name is None:
        return runs[0]
    for run in runs:
        if run.name == name:
            return run
    raise CLIError(f"{path}: no run named {name!r} (runs: {', '.join(r.name for r in runs)})")


def cmd_explain(args) -> int:
    from minisched.observe.explain import stories

    if args.slowest is not None and args.slowest < 1:
        raise CLIError("--slowest must be >= 1")
    run = pick_run(args.run, args.name)
    slowest = args.slowest
    if args.request is None and slowest is None and len(run.requests) > ALL_LIMIT:
        slowest = 5
        print(f"{len(run.requests)} requests: the 5 slowest by TTFT (--request ID or --slowest K for others)")
    try:
        out = stories(run, rids=args.request, slowest=slowest)
    except ValueError as exc:
        raise CLIError(str(exc)) from exc
    print("\n\n".join(out))
    return 0
