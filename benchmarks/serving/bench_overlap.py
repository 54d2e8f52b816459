"""Overlap scheduling on the CPU -- not a test.

    python benchmarks/serving/bench_overlap.py [--model smollm2 dummy:tiny] [--batch 8 32] [--rounds 3] [--json out.json]

For each model and batch size B: B prompts of --prompt-len tokens run to --new-tokens greedy tokens
(ignore_eos) on two engines over the same weights, overlap off and on, alternated (off, on, on, off,
...) for --rounds rounds so both see the same machine load. Per run:

- wall time and output tokens/s of the whole `generate`;
- forward time: the sum of `ModelRunner.execute` intervals (forward + sampling), on whichever
  thread runs them;
- scheduler share: the fraction of the wall time in which no forward ran (`1 - forward / wall`):
  scheduling, batch building, input preparation, result processing -- what overlap hides;
- steps and forwards (overlap computes one dropped step past each batch's last token at most).

The medians, the on/off throughput ratio and /proc/loadavg before and after go to stdout and --json.
Outputs of the two engines are compared (identical greedy tokens), so a speedup never hides a bug.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from minisched.base.cpus import loadavg
from minisched.engine import Engine
from minisched.sched.sampling_params import SamplingParams


def timed(engine: Engine) -> list:
    """Record the (start, end) of every forward + sampling (`ModelRunner.execute`), on any thread."""
    spans: list = []
    real = engine.runner.execute

    def execute(job):
        t0 = time.perf_counter()
        try:
            return real(job)
        finally:
            spans.append((t0, time.perf_counter()))

    engine.runner.execute = execute
    return spans


def one_run(engine: Engine, spans: list, prompts: list[list[int]], sp: SamplingParams) -> dict:
    engine.scheduler.flush_cache()  # cache-cold: every run computes the same
    spans.clear()
    steps0 = len(engine.step_times)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, sp)
    if engine._overlap is not None:  # the step launched last (dropped) still runs: count it in this run
        engine._overlap.close()
    wall = time.perf_counter() - t0
    fwd = sum(e - s for s, e in spans)
    step_wall = sum(e - s for s, e in engine.step_times[steps0:])
    tokens = sum(len(o.token_ids) for o in outs)
    return dict(
        wall=wall,
        tok_s=tokens / wall,
        forward=fwd,
        sched_share=max(0.0, 1 - fwd / wall),
        steps=len(engine.step_times) - steps0,
        forwards=len(spans),
        step_wall=step_wall,
        tokens=[o.token_ids for o in outs],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["dummy:tiny", "smollm2"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="Engine num_threads (default: tuned)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    result = dict(loadavg_before=loadavg(), args=vars(args), torch_threads=torch.get_num_threads(), cases=[])
    for model in args.model:
        base = Engine(model, num_threads=args.threads, overlap=False)
        engines = {
            False: base,
            True: Engine(base.model, tokenizer=base.tokenizer, num_threads=args.threads, overlap=True),
        }
        # the weights' format as base resolved it (auto: gguf for SmolLM2); the overlap engine runs the same
        # model object (its own config cannot tell: a model object resolves auto to none)
        quantize = base.quant.mode
        print(f"{model}: quantize {quantize}, backend {base.backend}", flush=True)
        spans = {ov: timed(eng) for ov, eng in engines.items()}
        vocab = base.cfg.vocab_size
        for b in args.batch:
            g = torch.Generator().manual_seed(b)
            prompts = [torch.randint(3, min(vocab, 30000), (args.prompt_len,), generator=g).tolist() for _ in range(b)]
            sp = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
            for eng in engines.values():  # warm-up
                eng.generate(prompts[:1], SamplingParams(max_new_tokens=2, ignore_eos=True))
            runs = {False: [], True: []}
            for r in range(args.rounds):
                for ov in (False, True) if r % 2 == 0 else (True, False):
                    runs[ov].append(one_run(engines[ov], spans[ov], prompts, sp))
            same = all(x["tokens"] == runs[False][0]["tokens"] for x in runs[False] + runs[True])
            med = {
                ov: {
                    k: statistics.median(x[k] for x in runs[ov])
                    for k in ("wall", "tok_s", "forward", "sched_share", "steps", "forwards", "step_wall")
                }
                for ov in runs
            }
            case = dict(
                model=model,
                quantize=quantize,
                batch=b,
                off=med[False],
                on=med[True],
                same_tokens=same,
                ratio_tok_s=med[True]["tok_s"] / med[False]["tok_s"],
            )
            result["cases"].append(case)
            print(
                f"{model:12s} B={b:3d}  off: {med[False]['tok_s']:8.1f} tok/s sched {med[False]['sched_share']:6.1%}"
                f"  on: {med[True]['tok_s']:8.1f} tok/s sched {med[True]['sched_share']:6.1%}"
                f"  on/off {case['ratio_tok_s']:.3f}  same tokens: {same}",
                flush=True,
            )
    result["loadavg_after"] = loadavg()
    print(f"loadavg before {result['loadavg_before']} after {result['loadavg_after']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
