"""`minisched replay RUN`: re-drive the scheduler from a recorded run and check every decision
(minisched/sched/replay.py); with scheduling options (`--policy lpm --chunk-size 256 --num-pages N`
...), predict the same traffic under them instead (minisched/observe/whatif.py).

`serve --record` writes a series of files per engine process; a file after its first starts mid-run,
so replay takes the whole series from its first file: `minisched replay runs/serve.r0.<series>.*.json`
(observe/record_series.py joins them)."""

from __future__ import annotations

import argparse
import json

from minisched.base.flags import add_flags, given_flag_values
from minisched.cli.common import CLIError, Formatter, name_flags
from minisched.cli.explain import pick_run


def add_parser(sub) -> argparse.ArgumentParser:
    from minisched.sched.config import SchedulerConfig

    p = sub.add_parser(
        "replay",
        help="replay a recorded run exactly, or predict it under other scheduling options",
        formatter_class=Formatter,
        description=__doc__,
    )
    p.add_argument(
        "run",
        nargs="+",
        help="run file (bench --json, generate --record), or the files of one `serve --record` series",
    )
    p.add_argument("--name", default=None, help="the run of the file to read (default: the first)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    g = p.add_argument_group("what-if (any of these: predict the run under them)")
    g.add_argument("--num-pages", type=int, default=argparse.SUPPRESS, help="KV pool pages")
    add_flags(g, SchedulerConfig(), suppress=True)
    return p


def cmd_replay(args) -> int:
    from minisched.sched.config import SchedulerConfig
    from minisched.sched.replay import JournalError, replay

    run, where = _the_run(args.run, args.name)
    if not run.journal:
        raise CLIError(f"{where}: run {run.name!r} has no journal (recorded before decisions were journalled)")
    overrides = given_flag_values(args, SchedulerConfig)
    if getattr(args, "num_pages", None) is not None:
        overrides["num_pages"] = args.num_pages
    if overrides:
        return _what_if(args, run, overrides)
    try:
        result = replay(run.journal)
    except JournalError as exc:
        raise CLIError(f"{where}: {exc}") from exc
    if args.json:
        d = result.divergence
        print(
            json.dumps(
                {
                    "identical": result.identical,
                    "steps": result.steps,
                    "divergence": None
                    if d is None
                    else {
                        "index": d.index,
                        "step": d.step,
                        "recorded": d.recorded,
                        "replayed": d.replayed,
                        "state": d.state,
                    },
                }
            )
        )
    elif result.identical:
        print(f"identical, {result.steps} steps ({len(run.journal)} journal entries)")
    else:
        d = result.divergence
        assert d is not None
        print(f"differs at step {d.step} (journal entry {d.index}):")
        print(f"  recorded: {json.dumps(d.recorded)}")
        print(f"  replayed: {json.dumps(d.replayed)}")
        print(f"  replayed state: {d.state}")
    return 0 if result.identical else 1


def _the_run(paths: list[str], name: str | None):
    """(the run to replay, how to name it in errors): one file's run, or one series' files joined."""
    from minisched.observe.record_series import join_series, record_info, starts_mid_run

    if len(paths) == 1:
        run = pick_run(paths[0], name)
        info = record_info(run)
        if starts_mid_run(run) and info is not None:
            raise CLIError(
                f"{paths[0]}: segment {info['segment']} of series {info['series']} starts mid-run (step "
                f"{info.get('first_step')}): replay needs the series from its first file, "
                f"e.g. minisched replay {_series_glob(paths[0], info)}"
            )
        return run, paths[0]
    runs = [(path, pick_run(path, name)) for path in paths]
    try:
        return join_series(runs), f"series {paths[0]} ..."
    except ValueError as exc:
        raise CLIError(str(exc)) from exc


def _series_glob(path: str, info: dict) -> str:
    """The shell pattern of a series' files, from one of them."""
    marker = f".{info['series']}."
    head, _, tail = path.rpartition(marker)
    return f"{head}{marker}*{tail[tail.find('.') :]}" if head else path


def _what_if(args, run, overrides: dict) -> int:
    from minisched.observe.whatif import predict
    from minisched.sched.replay import JournalError

    try:
        pred = predict(run, overrides)
    except JournalError as exc:
        raise CLIError(f"run {run.name!r}: {exc}") from exc
    except ValueError as exc:  # an invalid combination of settings
        raise CLIError(name_flags(str(exc))) from exc
    if args.json:
        print(json.dumps(pred.to_dict()))
    else:
        print(pred.table())
    return 0
