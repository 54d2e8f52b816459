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
import json
import sys
import time

from minisched.sched.req import SamplingParams

SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed", "max_new_tokens", "stop", "stop_token_ids", "ignore_eos")


class CLIError(Exception):
    pass


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="'smollm2' (default), a .gguf file, an HF safetensors dir, dummy:<preset>")
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    g.add_argument("--backend", default="auto", choices=["auto", "native", "triton", "torch"])
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--num-pages", type=int, default=None)
    g.add_argument("--mem-fraction", type=float, default=None)
    g.add_argument("--policy", default="fcfs", choices=["fcfs", "lpm", "dfs-weight", "lof"])
    g.add_argument("--chunk-size", type=int, default=512)
    g.add_argument("--max-running-requests", type=int, default=64)
    g.add_argument("--no-radix-cache", action="store_true")
    g.add_argument("--mixed-chunk", action="store_true")
    g.add_argument("--cascade", action="store_true", help="cascade decode for requests sharing prefix pages")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minisched", description="paged-attention LLM serving on a compact scheduler")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for prompts")
    g.add_argument("prompts", nargs="*", help="prompt texts")
    g.add_argument("--file", default=None, help="JSON-lines prompts file ('-' for stdin)")
    g.add_argument("--chat", action="store_true", help="wrap text prompts in the chat template")
    g.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    g.add_argument("--json", action="store_true", help="print one JSON object per output")
    _sampling_args(g)
    _engine_args(g)
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
    _engine_args(b)
    r = sub.add_parser("report", help="lifecycle report of a bench JSON (see minisched.observe.report)", add_help=False)
    r.add_argument("rest", nargs=argparse.REMAINDER)
    return p


def make_engine(args):
    import torch

    from minisched.engine import Engine
    from minisched.model.weights import ModelNotFound

    dtype = getattr(torch, args.dtype) if args.dtype else None
    try:
        return Engine(args.model, device=args.device, dtype=dtype, backend=args.backend, page_size=args.page_size,
                      num_pages=args.num_pages, mem_fraction=args.mem_fraction, policy=args.policy,
                      chunk_size=args.chunk_size or None, max_running_requests=args.max_running_requests,
                      enable_radix_cache=not args.no_radix_cache, enable_mixed_chunk=args.mixed_chunk,
                      cascade=args.cascade, num_threads=args.threads)
    except ModelNotFound as exc:
        raise CLIError(f"model not found: {exc}") from exc
    except (ValueError, RuntimeError) as exc:
        raise CLIError(str(exc)) from exc


def sampling_from(args, overrides: dict | None = None) -> SamplingParams:
    base = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                max_new_tokens=args.max_new_tokens, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    base.update(overrides or {})
    try:
        return SamplingParams(**base)
    except ValueError as exc:
        raise CLIError(str(exc)) from exc


def read_prompts(args) -> list[tuple[object, dict]]:
    items: list[tuple[object, dict]] = [(text, {}) for text in args.prompts]
    if args.file:
        f = sys.stdin if args.file == "-" else None
        try:
            f = f or open(args.file)
        except OSError as exc:
            raise CLIError(f"cannot read --file: {exc}") from exc
        with f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise CLIError(f"{args.file}:{n}: not JSON ({exc.msg})") from exc
                if isinstance(obj, str):
                    items.append((obj, {}))
                elif isinstance(obj, dict) and ("prompt" in obj or "messages" in obj):
                    unknown = set(obj) - {"prompt", "messages", "id"} - set(SAMPLING_FIELDS)
                    if unknown:
                        raise CLIError(f"{args.file}:{n}: unknown fields {sorted(unknown)}")
                    items.append((obj.get("messages", obj.get("prompt")),
                                  {k: (tuple(v) if isinstance(v, list) else v) for k, v in obj.items()
                                   if k in SAMPLING_FIELDS}))
                else:
                    raise CLIError(f"{args.file}:{n}: expected a string or an object with 'prompt' or 'messages'")
    if not items:
        raise CLIError("no prompts: pass prompt texts or --file")
    return items


def cmd_generate(args) -> int:
    items = read_prompts(args)
    params = [sampling_from(args, o) for _, o in items]
    engine = make_engine(args)
    prompts = [p for p, _ in items]
    multi = len(prompts) > 1
    failed = 0
    if args.stream and not args.json:
        for chunk in engine.stream(prompts, params, chat=args.chat):
            if chunk.output is not None and chunk.output.error:
                print(f"error: prompt {chunk.index}: {chunk.output.error}", file=sys.stderr)
                failed += 1
                continue
            prefix = f"[{chunk.index}] " if multi else ""
            if chunk.delta:
                sys.stdout.write(prefix + chunk.delta + ("\n" if multi else ""))
                sys.stdout.flush()
            if chunk.finished and not multi:
                sys.stdout.write("\n")
        return 1 if failed else 0
    outs = engine.generate(prompts, params, chat=args.chat)
    for o in outs:
        if o.error:
            failed += 1
            print(f"error: prompt {o.index}: {o.error}", file=sys.stderr)
            if args.json:
                print(json.dumps({"index": o.index, "error": o.error}))
            continue
        if args.json:
            print(json.dumps({"index": o.index, "text": o.text, "token_ids": o.token_ids,
                              "finish_reason": o.finish_reason, "prompt_tokens": len(o.prompt_ids),
                              "cached_tokens": o.cached_tokens, "ttft_s": o.ttft, "e2e_latency_s": o.e2e_latency}))
        elif multi:
            print(f"=== [{o.index}] ({o.finish_reason}) ===\n{o.text}")
        else:
            print(o.text)
    return 1 if failed else 0


def _fmt_ms(d: dict) -> str:
    return "/".join("-" if d[k] is None else f"{d[k] * 1e3:.0f}" for k in ("p50", "p90", "p99"))


def format_summary(s: dict) -> str:
    return (f"{s['name']}: {s['completed']}/{s['num_requests']} requests in {s['duration_s']:.1f}s | "
            f"in {s['input_tok_s']:.1f} tok/s, out {s['output_tok_s']:.1f} tok/s | "
            f"TTFT p50/p90/p99 {_fmt_ms(s['ttft_s'])} ms | TPOT {_fmt_ms(s['tpot_s'])} ms | "
            f"e2e {_fmt_ms(s['e2e_latency_s'])} ms | cache hit {s['cache_hit_rate']:.1%} | "
            f"retractions {s['retractions']} | scheduler {s['scheduler_overhead_share']:.1%}")


class StatusLine:
    """Live progress on stderr: one \r-rewritten line on a terminal (4 updates/s), else a line every 10 s."""

    def __init__(self, label: str, enabled: bool):
        self.label, self.enabled, self.tty, self.last = label, enabled, sys.stderr.isatty(), 0.0

    def __call__(self, p: dict) -> None:
        now = time.monotonic()
        if not self.enabled or now - self.last < (0.25 if self.tty else 10.0):
            return
        self.last = now
        line = (f"{self.label}: {p['elapsed']:6.1f}s  done {p['done']}/{p['total']}  "
                f"running {p['running']:3d}  waiting {p['waiting']:3d}")
        sys.stderr.write(f"\r{line}   " if self.tty else line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")


def cmd_bench(args) -> int:
    from minisched.observe import workloads as bw

    if args.num_requests < 1:
        raise CLIError("--num-requests must be >= 1")
    engine = make_engine(args)
    workload = bw.make_workload(args.workload, args.num_requests, args.rate, vocab=engine.cfg.vocab_size,
                                seed=args.seed, scale=args.scale)
    longest = max(len(r.prompt_ids) + r.max_new_tokens for r in workload)
    if longest > engine.sched_config.max_context_len:
        raise CLIError(f"the workload needs {longest}-token contexts but max_context_len is "
                       f"{engine.sched_config.max_context_len}; use --scale or a bigger --num-pages")
    runs, records = [], []
    modes = ["continuous"] + (["static"] if args.compare == "static" else [])
    for mode in modes:
        if mode != modes[0]:
            engine = make_engine_like(engine, args, enable_radix_cache=False)  # static: no prefix reuse
        status = StatusLine(f"{args.workload}/{mode}", not args.no_progress)
        result = bw.run_workload(engine, workload, mode, static_batch=args.static_batch, progress=status)
        status.close()
        s = bw.summarize(result)
        runs.append(s)
        print(format_summary(s))
        records.append(bw.run_record(engine, result, config={"workload": args.workload, "mode": mode,
                                                            "model": args.model or "smollm2",
                                                            "backend": engine.backend, "rate": args.rate,
                                                            "workload_stats": bw.workload_stats(workload)}))
    if len(runs) == 2:
        a, b = runs
        print(f"continuous vs static: throughput x{a['output_tok_s'] / max(b['output_tok_s'], 1e-9):.2f}, "
              f"p99 e2e latency x{a['e2e_latency_s']['p99'] / max(b['e2e_latency_s']['p99'], 1e-9):.2f}")
    if args.json:
        from minisched.observe.run_record import save_runs

        save_runs(args.json, records)
        print(f"wrote {args.json}")
    if args.trace:
        from minisched.observe.trace import write_chrome_trace

        write_chrome_trace(args.trace, records if len(records) > 1 else records[0])
        print(f"wrote {args.trace} (open it in ui.perfetto.dev or chrome://tracing)")
    return 0


def make_engine_like(engine, args, enable_radix_cache: bool):
    """A fresh engine (empty cache) on the same loaded model."""
    from minisched.engine import Engine

    return Engine(engine.model, tokenizer=engine.tokenizer, backend=args.backend, page_size=args.page_size,
                  num_pages=engine.sched_config.num_pages, policy=args.policy, chunk_size=args.chunk_size or None,
                  max_running_requests=args.max_running_requests, enable_radix_cache=enable_radix_cache,
                  enable_mixed_chunk=args.mixed_chunk, cascade=args.cascade)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "report":
        from minisched.observe import report

        return report.main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return cmd_generate(args) if args.command == "generate" else cmd_bench(args)
    except CLIError as exc:
        print(f"minisched: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
