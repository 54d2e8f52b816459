"""The `minisched` command line (also `python -m minisched`).

    minisched generate "prompt" ... [--chat] [--file prompts.jsonl] [--stream] [--max-new-tokens N] ...
    minisched chat                    interactive, multi-turn; each turn reuses the cached conversation
    minisched bench --workload {mixed,shared-prefix,long-prompt,poisson} --num-requests N --rate R
                    [--compare static] [--json out.json]
    minisched report run.json -o report.png [--html ...] [--trace ...]
    minisched serve [--host 127.0.0.1] [--port 30000] [--api-key KEY]   OpenAI-compatible HTTP server
    minisched explain run.json [--request ID] [--slowest K]   why each request waited, how it ran
    minisched replay run.json [--policy lpm --chunk-size 256 --num-pages N ...]   exact replay / what-if

`--file` takes JSON lines: a string, or an object with "prompt" (text or token ids) or
"messages" (chat), and optional sampling fields ("max_new_tokens", "temperature", ...).
Errors (missing model, bad arguments, an impossible pool size) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import sys

from minisched.cli import explain as explain_cli
from minisched.cli import replay as replay_cli
from minisched.cli import serve as serve_cli
from minisched.cli.common import CLIError, Formatter, engine_args, run_tp_worker, sampling_args


def _version() -> str:
    import minisched

    return f"minisched {minisched.__version__}"


class _VersionAction(argparse.Action):
    """`--version`: the version and the CPU kernels' ISA variant (imports torch: only when asked)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from minisched.ops import cpu

        print(f"{_version()}\n{cpu.describe()}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="minisched", description=__doc__.split("\n\n")[0].strip(), formatter_class=Formatter
    )
    p.add_argument("--version", action=_VersionAction, help="print the version and the CPU kernels' ISA, then exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    g = sub.add_parser(
        "generate", help="generate text for prompts", formatter_class=Formatter, description=generate_doc()
    )
    g.add_argument("prompts", nargs="*", help="prompt texts")
    g.add_argument("--file", default=None, help="JSON-lines prompts file ('-' for stdin)")
    g.add_argument("--chat", action="store_true", help="wrap text prompts in the chat template")
    g.add_argument("--stream", action="store_true", help="print text as it is generated")
    g.add_argument("--json", action="store_true", help="print one JSON object per output (per chunk with --stream)")
    g.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    g.add_argument("--record", default=None, help="write the run (events, journal) here: minisched explain / replay")
    sampling_args(g)
    engine_args(g)
    c = sub.add_parser(
        "chat", help="interactive multi-turn chat (each turn reuses the cached conversation)", formatter_class=Formatter
    )
    c.add_argument("--system", default=None, help="system prompt")
    sampling_args(c)
    engine_args(c)
    c.set_defaults(max_new_tokens=256)
    b = sub.add_parser("bench", help="serving benchmark on a synthetic workload", formatter_class=Formatter)
    b.add_argument(
        "--workload",
        default="mixed",
        choices=["mixed", "shared-prefix", "long-prompt", "poisson"],
        help="request mix (see minisched.observe.workloads)",
    )
    b.add_argument("--num-requests", type=int, default=64, help="requests in the workload")
    b.add_argument("--rate", type=float, default=4.0, help="Poisson arrival rate, requests/s (<= 0: all at once)")
    b.add_argument("--compare", default=None, choices=["static"], help="also run the static-batching baseline")
    b.add_argument("--static-batch", type=int, default=8, help="batch size of the static baseline")
    b.add_argument("--scale", type=float, default=1.0, help="scale prompt/output lengths (quick runs)")
    b.add_argument("--seed", type=int, default=0, help="workload seed")
    b.add_argument("--json", default=None, help="write summary + per-request timeline (RunRecord layout) here")
    b.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace of every request and step here")
    b.add_argument("--no-progress", action="store_true", help="no live status line")
    h = b.add_argument_group("over HTTP (any OpenAI-compatible server; the engine options are then unused)")
    h.add_argument("--url", default=None, help="e.g. http://127.0.0.1:30000: benchmark that server instead")
    h.add_argument("--served-model", default=None, help="model name to send (default: the server's first model)")
    h.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    h.add_argument("--vocab-size", type=int, default=49152, help="token ids of the random prompts stay below this")
    engine_args(b)
    serve_cli.add_parser(sub).formatter_class = Formatter
    explain_cli.add_parser(sub)
    replay_cli.add_parser(sub)
    sub.add_parser(
        "report", help="lifecycle report of a bench JSON (minisched report -h for its options)", add_help=False
    ).add_argument("rest", nargs=argparse.REMAINDER)
    return p


def generate_doc() -> str:
    from minisched.cli import generate

    return generate.__doc__


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "report":
        from minisched.observe import report

        return report.main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.command == "explain":
            return explain_cli.cmd_explain(args)
        if args.command == "replay":
            return replay_cli.cmd_replay(args)
        status = run_tp_worker(args)  # torchrun's ranks > 0 of --tp N
        if status is not None:
            return status
        if args.command == "generate":
            from minisched.cli.generate import cmd_generate

            return cmd_generate(args)
        if args.command == "chat":
            from minisched.cli.chat import cmd_chat

            return cmd_chat(args)
        if args.command == "serve":
            return serve_cli.cmd_serve(args)
        from minisched.cli.bench import cmd_bench

        return cmd_bench(args)
    except CLIError as exc:
        print(f"minisched: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("minisched: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
