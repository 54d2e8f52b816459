"""The `minisched` command line (also `python -m minisched`).

    minisched generate "prompt" ... [--chat] [--file prompts.jsonl] [--stream] [--max-new-tokens N] ...
    minisched bench --workload {mixed,shared-prefix,long-prompt,poisson} --num-requests N --rate R
                    [--compare static] [--json out.json]
    minisched report run.json -o report.png [--html ...] [--trace ...]

`--file` takes JSON lines: a string, or an object with "prompt" (text or token ids) or
"messages" (chat), and optional sampling fields ("max_new_tokens", "temperature", ...).
Errors (missing model, bad arguments, an impossible pool size) print one line and exit 2.
"""
from __future__ import annotations

import argparse
import sys

from minisched.cli.common import CLIError, engine_args, sampling_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minisched", description="paged-attention LLM serving on a compact scheduler")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for prompts")
    g.add_argument("prompts", nargs="*", help="prompt texts")
    g.add_argument("--file", default=None, help="JSON-lines prompts file ('-' for stdin)")
    g.add_argument("--chat", action="store_true", help="wrap text prompts in the chat template")
    g.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    g.add_argument("--json", action="store_true", help="print one JSON object per output")
    sampling_args(g)
    engine_args(g)
    b = sub.add_parser("bench", help="serving benchmark on a synthetic workload")
    b.add_argument("--workload", default="mixed", choices=["mixed", "shared-prefix", "long-prompt", "poisson"])
    b.add_argument("--num-requests", type=int, default=64)
    b.add_argument("--rate", type=float, default=4.0, help="Poisson arrival rate, requests/s (<= 0: all at once)")
    b.add_argument("--compare", default=None, choices=["static"], help="also run the static-batching baseline")
    b.add_argument("--static-batch", type=int, default=8)
    b.add_argument("--scale", type=float, default=1.0, help="scale prompt/output lengths (quick runs)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--json", default=None, help="write summary + per-request timeline (RunRecord layout) here")
    b.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace of every request and step here")
    b.add_argument("--no-progress", action="store_true")
    engine_args(b)
    r = sub.add_parser("report", help="lifecycle report of a bench JSON (see minisched.observe.report)", add_help=False)
    r.add_argument("rest", nargs=argparse.REMAINDER)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "report":
        from minisched.observe import report

        return report.main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            from minisched.cli.generate import cmd_generate

            return cmd_generate(args)
        from minisched.cli.bench import cmd_bench

        return cmd_bench(args)
    except CLIError as exc:
        print(f"minisched: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130




if __name__ == "__main__":
    sys.exit(main())
