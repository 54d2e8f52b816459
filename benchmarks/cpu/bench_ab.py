"""Two checkouts of minisched, A and B, on the same prompts: paired, alternating prefills (or short
generations) in two long-lived processes, one per checkout (each imports its own tree and extension,
PYTHONPATH=<tree>). A kernel change is measured against the commit before it without a switch in the
product: build the old commit in a worktree (`git worktree add ../base <commit>`, then
`MINISCHED_CUDA=0 python setup.py build_ext --inplace` there) and compare.

Why pairs: this class of machine drifts by up to 1.7x between runs, so medians of separate runs cannot
resolve 10 %. Here each pair's two requests run back to back (order alternating, a pause between
requests so one process's spinning OpenMP threads do not tax the other's turn), and the report is the
median and quartiles of the per-pair ratios A / B (> 1: B is faster).

    python benchmarks/cpu/bench_ab.py --a ../base --b . [--model smollm2] [--quantize none] [--tokens 512] [--new-tokens 1] \\
        [--threads 2 (0: tuned)] [--pairs 16] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

WORKER = """
import sys, time
import numpy as np
from minisched import Engine, SamplingParams
from minisched.ops.cpu import describe
model, quantize, tokens, new_tokens, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
engine = Engine(model, num_threads=threads or None, quantize=quantize)  # 0: tuned (the default)
lo, hi = (100, min(40000, engine.cfg.vocab_size)) if engine.cfg.vocab_size > 1000 else (0, engine.cfg.vocab_size)
sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
rng = np.random.default_rng(0)  # both processes draw the same prompts, in the same order
engine.generate([rng.integers(lo, hi, size=tokens).tolist()], sp)  # warm
print(engine.quant.mode, describe(), flush=True)
for _ in sys.stdin:
    ids = rng.integers(lo, hi, size=tokens).tolist()  # fresh ids: no prefix-cache hit
    t = time.perf_counter()
    engine.generate([ids], sp)
    print(time.perf_counter() - t, flush=True)
"""


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", required=True, help="checkout A (the baseline)")
    p.add_argument("--b", required=True, help="checkout B")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--quantize", default="none")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=1, help="1: a prefill")
    p.add_argument("--threads", type=int, default=2, help="0: the engine's default (tuned while it runs)")
    p.add_argument("--pairs", type=int, default=16)
    p.add_argument("--pause", type=float, default=0.5, help="seconds before each request")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    trees = {"a": os.path.abspath(a.a), "b": os.path.abspath(a.b)}
    args = [a.model, a.quantize, str(a.tokens), str(a.new_tokens), str(a.threads)]
    procs = {
        k: subprocess.Popen(
            [sys.executable, "-c", WORKER, *args],
            env=dict(os.environ, PYTHONPATH=tree),
            cwd=tree,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for k, tree in trees.items()
    }
    heads = {}
    for k, proc in procs.items():
        assert proc.stdout is not None
        heads[k] = proc.stdout.readline().strip()
        if not heads[k]:
            sys.exit(f"bench_ab: checkout {k} ({trees[k]}) did not start")
    secs: dict[str, list[float]] = {"a": [], "b": []}
    for i in range(a.pairs):
        for k in ("a", "b") if i % 2 == 0 else ("b", "a"):
            time.sleep(a.pause)
            stdin, stdout = procs[k].stdin, procs[k].stdout
            assert stdin is not None and stdout is not None
            stdin.write("go\n")
            stdin.flush()
            secs[k].append(float(stdout.readline()))
        print(f"pair {i + 1}/{a.pairs}: a {secs['a'][-1]:.3f} s, b {secs['b'][-1]:.3f} s", flush=True)
    for proc in procs.values():
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait()
    ratios = [x / y for x, y in zip(secs["a"], secs["b"])]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    out = dict(
        trees=trees,
        model=a.model,
        engines=heads,
        quantize=a.quantize,
        tokens=a.tokens,
        new_tokens=a.new_tokens,
        threads=a.threads,
        a_median_s=statistics.median(secs["a"]),
        b_median_s=statistics.median(secs["b"]),
        ratio_a_over_b_median=statistics.median(ratios),
        ratio_q1=q1,
        ratio_q3=q3,
        seconds=secs,
        load=os.getloadavg(),
    )
    print(
        f"{a.tokens} tokens (+{a.new_tokens - 1} decoded), quantize {a.quantize} [{heads['a']}]: "
        f"A/B per pair median {out['ratio_a_over_b_median']:.3f} (quartiles {q1:.3f}-{q3:.3f}); medians "
        f"A {out['a_median_s']:.3f} s, B {out['b_median_s']:.3f} s; load {out['load'][0]:.2f}"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
