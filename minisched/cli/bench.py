"""`minisched bench`: a synthetic serving workload, live status, summary, run JSON and trace."""

from __future__ import annotations

from minisched.cli.common import CLIError, check_output_path, engine_config, make_engine
from minisched.cli.status import StatusLine


def _fmt_ms(d: dict) -> str:
    return "/".join("-" if d[k] is None else f"{d[k] * 1e3:.0f}" for k in ("p50", "p90", "p99"))


def format_summary(s: dict) -> str:
    return (
        f"{s['name']}: {s['completed']}/{s['num_requests']} requests in {s['duration_s']:.1f}s | "
        f"in {s['input_tok_s']:.1f} tok/s, out {s['output_tok_s']:.1f} tok/s | "
        f"TTFT p50/p90/p99 {_fmt_ms(s['ttft_s'])} ms | TPOT {_fmt_ms(s['tpot_s'])} ms | "
        f"e2e {_fmt_ms(s['e2e_latency_s'])} ms | cache hit {s['cache_hit_rate']:.1%} | "
        f"retractions {s['retractions']} | scheduler {s['scheduler_overhead_share']:.1%}"
    )


def cmd_bench(args) -> int:
    from minisched.observe import workloads as bw

    if args.num_requests < 1:
        raise CLIError("--num-requests must be >= 1")
    check_output_path(args.json, "--json")
    check_output_path(args.trace, "--trace")
    if args.url:
        return _bench_http(args)
    config = engine_config(args)
    engine = make_engine(config)
    workload = bw.make_workload(
        args.workload, args.num_requests, args.rate, vocab=engine.cfg.vocab_size, seed=args.seed, scale=args.scale
    )
    longest = max(len(r.prompt_ids) + r.max_new_tokens for r in workload)
    if longest > engine.sched_config.max_context_len:
        raise CLIError(
            f"the workload needs {longest}-token contexts but max_context_len is "
            f"{engine.sched_config.max_context_len}; use --scale or a bigger --num-pages"
        )
    runs, records = [], []
    modes = ["continuous"] + (["static"] if args.compare == "static" else [])
    for mode in modes:
        if mode != modes[0]:
            engine = engine.fresh(enable_radix_cache=False)  # static: no prefix reuse, same loaded model
        status = StatusLine(f"{args.workload}/{mode}", not args.no_progress)
        result = bw.run_workload(engine, workload, mode, static_batch=args.static_batch, progress=status)
        status.close()
        s = bw.summarize(result)
        runs.append(s)
        print(format_summary(s) + (" (interrupted: partial)" if result.interrupted else ""))
        records.append(
            bw.run_record(
                engine,
                result,
                config={
                    "workload": args.workload,
                    "mode": mode,
                    "model": engine.model_name,
                    "backend": engine.backend,
                    "quantize": engine.quant.mode,  # as resolved (--quantize auto: gguf or none)
                    "rate": args.rate,
                    "workload_stats": bw.workload_stats(workload),
                    "interrupted": result.interrupted,
                },
            )
        )
        if result.interrupted:
            break
    interrupted = records and records[-1].config.get("interrupted")
    if len(runs) == 2:
        a, b = runs
        print(
            f"continuous vs static: throughput x{a['output_tok_s'] / max(b['output_tok_s'], 1e-9):.2f}, "
            f"p99 e2e latency x{a['e2e_latency_s']['p99'] / max(b['e2e_latency_s']['p99'], 1e-9):.2f}"
        )
    if args.json:
        from minisched.observe.run_record import save_runs

        save_runs(args.json, records)
        print(f"wrote {args.json}")
    if args.trace:
        from minisched.observe.trace import write_chrome_trace

        write_chrome_trace(args.trace, records if len(records) > 1 else records[0])
        print(f"wrote {args.trace} (open it in ui.perfetto.dev or chrome://tracing)")
    return 130 if interrupted else 0


def _bench_http(args) -> int:
    """The same workload against any OpenAI-compatible server, measured on the client side."""
    from minisched.observe import workloads as bw
    from minisched.observe.http_bench import run_http_bench

    if args.compare:
        raise CLIError("--compare runs in-process engines; it cannot be combined with --url")
    workload = bw.make_workload(
        args.workload, args.num_requests, args.rate, vocab=args.vocab_size, seed=args.seed, scale=args.scale
    )
    status = StatusLine(f"{args.workload}/http", not args.no_progress)
    try:
        summary, record = run_http_bench(
            args.url, workload, model=args.served_model, api_key=args.api_key, progress=status
        )
    except Exception as exc:  # connection refused, bad URL, not an OpenAI server
        raise CLIError(f"{args.url}: {type(exc).__name__}: {exc}") from exc
    finally:
        status.close()
    print(format_summary(summary) + (f" | failed {summary['failed']}" if summary.get("failed") else ""))
    for err in summary.get("errors", []):
        print(f"  error: {err}")
    if args.json:
        from minisched.observe.run_record import save_runs

        save_runs(args.json, [record])
        print(f"wrote {args.json}")
    if args.trace:
        from minisched.observe.trace import write_chrome_trace

        write_chrome_trace(args.trace, record)
        print(f"wrote {args.trace} (open it in ui.perfetto.dev or chrome://tracing)")
    return 1 if summary.get("failed") else 0
