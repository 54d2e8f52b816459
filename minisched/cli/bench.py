"""`minisched bench`: a synthetic serving workload, live status, summary, run JSON and trace."""
from __future__ import annotations

import sys
import time

from minisched.cli.common import CLIError, make_engine, make_engine_like


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
