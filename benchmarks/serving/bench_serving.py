"""End-to-end serving benchmark on SmolLM2-135M (CPU, fp32 arithmetic; the default weights) -- not a test.

Three comparisons, each in one process on the same loaded weights:

1. mixed workload (Poisson arrivals, outputs 16-256): continuous batching vs static batching
   (batches of --static-batch formed from whatever has arrived, run to completion);
   targets: >= 1.4x output throughput, <= 0.4x p99 end-to-end latency.
2. shared-prefix workload: radix cache + LPM vs no cache (FCFS); target >= 2x throughput.
3. the mixed workload's prompts through HF transformers `generate` in fixed batches of 8
   (left padding, greedy, each batch runs to its longest request) vs our continuous run;
   target >= 2x output tokens/s (useful tokens only: each request's own length).

    python benchmarks/serving/bench_serving.py [--quick] [--threads 2] [--out-dir benchmarks/results] [--skip-hf]

Writes <out-dir>/bench_serving.json ({"version": 1, "runs": [RunRecord...]} -- the layout of
minisched.observe.run_record, readable by `minisched report`; each run's "summary" holds its headline
numbers, and a top-level "comparisons" list holds the table rows) and bench_serving.md.
The development machines are shared: the load average is recorded with the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from minisched.cli.bench import format_summary
from minisched.engine import Engine
from minisched.observe import workloads as bw
from minisched.observe.run_record import RunRecord

RESULTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")


def progress(label):
    last = [0.0]

    def cb(p):
        now = time.monotonic()
        if now - last[0] >= 5.0:
            last[0] = now
            print(
                f"  {label}: {p['elapsed']:6.1f}s done {p['done']}/{p['total']} running {p['running']} "
                f"waiting {p['waiting']}",
                file=sys.stderr,
                flush=True,
            )

    return cb


def serve(base: Engine, workload, mode: str, name: str, records: list, **engine_kw) -> dict:
    engine = Engine(
        base.model, tokenizer=base.tokenizer, page_size=16, num_pages=base.sched_config.num_pages, **engine_kw
    )
    result = bw.run_workload(engine, workload, mode, static_batch=ARGS.static_batch, progress=progress(name), name=name)
    rec = bw.run_record(
        engine,
        result,
        config={
            "mode": mode,
            "engine": engine_kw,
            "backend": engine.backend,
            "workload_stats": bw.workload_stats(workload),
        },
    )
    records.append(rec)
    print(format_summary(rec.summary), flush=True)
    return rec.summary


def hf_static(workload, batch: int, gguf_path: str) -> dict:
    """HF transformers generate over the workload's prompts in fixed batches, all present at t=0."""
    from transformers import AutoModelForCausalLM

    d, name = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    t = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32, local_files_only=True).eval()
    load_s = time.monotonic() - t
    start = time.monotonic()
    useful, e2e = 0, []
    for i in range(0, len(workload), batch):
        group = workload[i : i + batch]
        longest = max(len(r.prompt_ids) for r in group)
        ids = torch.full((len(group), longest), 2, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, r in enumerate(group):  # left padding
            ids[b, longest - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[b, longest - len(r.prompt_ids) :] = 1
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(r.max_new_tokens for r in group),
                do_sample=False,
                eos_token_id=None,
                pad_token_id=2,
            )
        useful += sum(r.max_new_tokens for r in group)
        e2e += [time.monotonic() - start] * len(group)
        print(
            f"  hf: batch {i // batch + 1}/{-(-len(workload) // batch)} done at {time.monotonic() - start:.1f}s",
            file=sys.stderr,
            flush=True,
        )
    dur = time.monotonic() - start
    inp = sum(len(r.prompt_ids) for r in workload)
    return {
        "name": f"hf-generate-batch{batch}",
        "duration_s": dur,
        "load_s": load_s,
        "output_tokens": useful,
        "output_tok_s": useful / dur,
        "input_tok_s": inp / dur,
        "e2e_latency_s": bw.percentiles(e2e),
    }


def ratio(a, b):
    return None if not b else a / b


def main() -> int:
    global ARGS
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer, shorter requests (about a quarter of the work)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default=None)
    p.add_argument("--out-dir", default=RESULTS_DIR)
    p.add_argument("--static-batch", type=int, default=8)
    p.add_argument("--mixed-requests", type=int, default=None)
    p.add_argument("--mixed-rate", type=float, default=None)
    p.add_argument("--shared-requests", type=int, default=None)
    p.add_argument(
        "--shared-rate",
        type=float,
        default=4.0,
        help="shared-prefix arrivals, req/s (<= 0: all at t=0, so one batch admits every prefix cold)",
    )
    p.add_argument("--stages", default="mixed,shared,hf", help="comma-separated subset of mixed,shared,hf")
    p.add_argument("--skip-hf", action="store_true")
    ARGS = p.parse_args()
    torch.set_num_threads(ARGS.threads)
    quick = ARGS.quick
    n_mixed = ARGS.mixed_requests or (32 if quick else 64)
    rate = ARGS.mixed_rate or (2.0 if quick else 1.0)
    scale = 0.25 if quick else 1.0
    n_shared = ARGS.shared_requests or (16 if quick else 32)
    load0 = os.getloadavg()

    t = time.monotonic()
    base = Engine(ARGS.model, page_size=16, num_pages=4096)  # 64k-token pool: no retraction pressure here
    print(
        f"model loaded in {time.monotonic() - t:.1f}s; backend {base.backend}; {torch.get_num_threads()} threads",
        flush=True,
    )
    records: list[RunRecord] = []
    rows = []

    stages = set(ARGS.stages.split(",")) - ({"hf"} if ARGS.skip_hf else set())
    env = lambda: env_of(base, load0, n_mixed, rate, scale, n_shared)  # noqa: E731

    # 1. continuous vs static on the mixed workload
    mixed = bw.make_workload("mixed", n_mixed, rate, vocab=base.cfg.vocab_size, seed=0, scale=scale)
    if "mixed" in stages:
        cont = serve(base, mixed, "continuous", "mixed/continuous", records, max_running_requests=64)
        stat = serve(base, mixed, "static", f"mixed/static-batch{ARGS.static_batch}", records, max_running_requests=64)
        rows.append(
            {
                "comparison": "mixed: continuous vs static batching",
                "ours_tok_s": cont["output_tok_s"],
                "baseline_tok_s": stat["output_tok_s"],
                "throughput_x": ratio(cont["output_tok_s"], stat["output_tok_s"]),
                "target_throughput_x": 1.4,
                "ours_p99_s": cont["e2e_latency_s"]["p99"],
                "baseline_p99_s": stat["e2e_latency_s"]["p99"],
                "p99_latency_x": ratio(cont["e2e_latency_s"]["p99"], stat["e2e_latency_s"]["p99"]),
                "target_p99_latency_x": 0.4,
            }
        )
        save(rows, records, env())

    # 2. radix cache + LPM vs no cache on the shared-prefix workload
    shared = bw.make_workload(
        "shared-prefix", n_shared, ARGS.shared_rate, vocab=base.cfg.vocab_size, seed=1, scale=0.5 if quick else 1.0
    )
    if "shared" in stages:
        radix = serve(
            base, shared, "continuous", "shared-prefix/radix+lpm", records, policy="lpm", enable_radix_cache=True
        )
        nocache = serve(
            base, shared, "continuous", "shared-prefix/no-cache", records, policy="fcfs", enable_radix_cache=False
        )
        rows.append(
            {
                "comparison": "shared-prefix: radix+LPM vs no cache",
                "ours_tok_s": radix["output_tok_s"],
                "baseline_tok_s": nocache["output_tok_s"],
                "throughput_x": ratio(radix["output_tok_s"], nocache["output_tok_s"]),
                "target_throughput_x": 2.0,
                "ours_p99_s": radix["e2e_latency_s"]["p99"],
                "baseline_p99_s": nocache["e2e_latency_s"]["p99"],
                "p99_latency_x": ratio(radix["e2e_latency_s"]["p99"], nocache["e2e_latency_s"]["p99"]),
                "cache_hit_rate": radix["cache_hit_rate"],
            }
        )
        save(rows, records, env())

    # 3. HF transformers generate in fixed batches of 8, same prompts (all present at t=0), vs an offline run of ours
    if "hf" in stages:
        offline = [bw.BenchRequest(r.rid, r.prompt_ids, r.max_new_tokens, 0.0) for r in mixed]
        ours = serve(base, offline, "continuous", "mixed-offline/continuous", records, max_running_requests=64)
        from minisched.model.weights import resolve

        hf = hf_static(offline, 8, resolve(ARGS.model)[1])
        print(
            f"{hf['name']}: {hf['output_tokens']} useful tokens in {hf['duration_s']:.1f}s = "
            f"{hf['output_tok_s']:.1f} tok/s",
            flush=True,
        )
        rows.append(
            {
                "comparison": "mixed (offline): ours vs HF generate, batches of 8",
                "ours_tok_s": ours["output_tok_s"],
                "baseline_tok_s": hf["output_tok_s"],
                "throughput_x": ratio(ours["output_tok_s"], hf["output_tok_s"]),
                "target_throughput_x": 2.0,
                "ours_p99_s": ours["e2e_latency_s"]["p99"],
                "baseline_p99_s": hf["e2e_latency_s"]["p99"],
                "p99_latency_x": ratio(ours["e2e_latency_s"]["p99"], hf["e2e_latency_s"]["p99"]),
                "hf": hf,
            }
        )

    print(save(rows, records, env()))
    return 0


def env_of(base, load0, n_mixed, rate, scale, n_shared) -> dict:
    return {
        "quick": ARGS.quick,
        "threads": torch.get_num_threads(),
        "backend": base.backend,
        "quantize": base.quant.mode,  # as resolved: the default, auto, is gguf for SmolLM2
        "torch": torch.__version__,
        "loadavg_start": load0,
        "loadavg_end": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "mixed": {"num_requests": n_mixed, "rate": rate, "scale": scale, "static_batch": ARGS.static_batch},
        "shared_prefix": {"num_requests": n_shared, "rate": ARGS.shared_rate},
    }


def save(rows, records, env) -> str:
    """Write (or rewrite, after each stage) the JSON and the markdown table; returns the table."""
    os.makedirs(ARGS.out_dir, exist_ok=True)
    with open(os.path.join(ARGS.out_dir, "bench_serving.json"), "w") as f:
        json.dump(
            {"version": 1, "env": env, "comparisons": rows, "runs": [r.to_dict() for r in records]}, f, default=str
        )
    table = markdown(rows, env)
    with open(os.path.join(ARGS.out_dir, "bench_serving.md"), "w") as f:
        f.write(table)
    return table


def _f(v, fmt="{:.2f}"):
    return "-" if v is None else fmt.format(v)


def markdown(rows, env) -> str:
    lines = [
        f"SmolLM2-135M ({env['quantize']} weights, fp32 arithmetic), CPU, {env['threads']} threads, backend {env['backend']}, "
        f"{'--quick' if env['quick'] else 'full'} run, {env['date']}, load avg "
        f"{env['loadavg_start'][0]:.1f} -> {env['loadavg_end'][0]:.1f}",
        "",
        "| comparison | ours out tok/s | baseline out tok/s | throughput x (target) | ours p99 e2e s "
        "| baseline p99 e2e s | p99 x (target) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tp = f"{_f(r['throughput_x'])} (>= {r['target_throughput_x']})"
        lat = _f(r["p99_latency_x"]) + (f" (<= {r['target_p99_latency_x']})" if "target_p99_latency_x" in r else "")
        lines.append(
            f"| {r['comparison']} | {_f(r['ours_tok_s'], '{:.1f}')} | {_f(r['baseline_tok_s'], '{:.1f}')} "
            f"| {tp} | {_f(r['ours_p99_s'], '{:.1f}')} | {_f(r['baseline_p99_s'], '{:.1f}')} | {lat} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
