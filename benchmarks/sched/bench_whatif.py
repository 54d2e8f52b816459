"""Validate what-if replay (minisched/observe/whatif.py) against actually running the setting.

For each workload (the demo's shared-prefix and the mixed one, SmolLM2 on this machine's CPU) a
baseline run is recorded; from it, `predict` gives TTFT p50 / p99, output throughput and cache hit
rate under three changed settings (policy, chunk size, pool size); each setting is then actually run
on the same loaded model in the same benchmark run, interleaved with repeats of the baseline.
Bounds: TTFT p50 and throughput within 15 %, p99 within 25 %. The baseline is also run again: that row's
error is the machine's run-to-run noise, the floor under every other row. Prints a markdown table, JSON beside.

    python benchmarks/sched/bench_whatif.py [--num-requests 24] [--scale 0.25] [--rate 4] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform

from minisched.engine import Engine
from minisched.engine.config import EngineConfig
from minisched.observe import workloads as bw
from minisched.observe.whatif import predict, recorded

BOUNDS = {"ttft_p50": 0.15, "output_tok_s": 0.15, "ttft_p99": 0.25}


def run_once(engine, workload, name):
    result = bw.run_workload(engine, workload, "continuous", name=name)
    return bw.run_record(engine, result)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--scale", type=float, default=0.25)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--num-pages", type=int, default=256)
    ap.add_argument("--workloads", default="shared-prefix,mixed")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    base_cfg = {"num_pages": args.num_pages, "page_size": 16, "chunk_size": 512, "policy": "lpm"}
    # {}: the baseline run again -- its "prediction" is the simulation of the recorded settings, and the
    # rerun's difference from it is the run-to-run noise floor of this machine under its load now
    settings = [{}, {"policy": "fcfs"}, {"chunk_size": 64}, {"num_pages": max(24, args.num_pages // 4)}]
    engine0 = Engine(config=EngineConfig().with_options(**base_cfg))
    rows, out = [], {"load_start": os.getloadavg(), "machine": platform.processor() or platform.machine(), "runs": []}
    out["quantize"] = engine0.quant.mode  # as resolved (the default, auto: gguf for SmolLM2); fresh() keeps it
    print(f"{engine0.model_name}: quantize {out['quantize']}, backend {engine0.backend}", flush=True)
    for wl in args.workloads.split(","):
        workload = bw.make_workload(wl, args.num_requests, args.rate, vocab=engine0.cfg.vocab_size, scale=args.scale)
        base = run_once(engine0.fresh(**base_cfg), workload, f"{wl}/base")
        for setting in settings:
            pred = predict(base, setting)  # (an empty setting predicts the recorded settings)
            actual_rec = run_once(engine0.fresh(**{**base_cfg, **setting}), workload, f"{wl}/{setting}")
            actual = recorded(actual_rec)
            errs = {}
            for key in BOUNDS:
                want, got = getattr(actual, key), getattr(pred.predicted, key)
                errs[key] = None if not want or got is None else (got - want) / want
            rows.append((wl, setting, pred, actual, errs))
            out["runs"].append(
                {
                    "workload": wl,
                    "setting": setting,
                    "prediction": pred.to_dict(),
                    "actual": actual.row(),
                    "errors": errs,
                }
            )
            print(f"{wl} {setting}: errors {errs}", flush=True)
    out["load_end"] = os.getloadavg()
    print(
        "\n| workload | setting | TTFT p50 pred / ran (s) | TTFT p99 pred / ran (s) | tok/s pred / ran | hit pred / ran | errors p50, p99, tok/s | model R^2, error |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for wl, setting, pred, actual, errs in rows:
        p = pred.predicted

        def e(k):
            return "-" if errs[k] is None else f"{errs[k]:+.0%}"

        print(
            f"| {wl} | {', '.join(f'{k}={v}' for k, v in setting.items()) or 'baseline again'} | {p.ttft_p50:.2f} / {actual.ttft_p50:.2f} | "
            f"{p.ttft_p99:.2f} / {actual.ttft_p99:.2f} | {p.output_tok_s:.1f} / {actual.output_tok_s:.1f} | "
            f"{p.cache_hit_rate:.0%} / {actual.cache_hit_rate:.0%} | {e('ttft_p50')}, {e('ttft_p99')}, {e('output_tok_s')} | "
            f"{pred.model.r2:.2f}, {pred.model.mean_abs_err:.0%} |"
        )
    print(f"load {out['load_start']} -> {out['load_end']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
