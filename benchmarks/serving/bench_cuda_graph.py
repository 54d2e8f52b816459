"""End-to-end decode with and without CUDA graphs, for benchmarks/device_check.sh -- not a test.

    python benchmarks/serving/bench_cuda_graph.py [--model dummy:llama3-1b] [--batch 1 8 32] [--rounds 2] [--json out.json]

One process, one set of weights, two engines (cuda_graph off / on), runs alternated (off, on, on,
off, ...). Per batch size B: B prompts of --prompt-len tokens to --new-tokens greedy tokens;
reports output tok/s of each, the on/off ratio, the capture time, the graph replays, and the share
of tokens equal between the two (a padded bucket may pick other GEMM kernels than the eager
batch, so bf16 greedy tokens can drift late in a sequence; the first tokens must agree).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from minisched.engine import Engine
from minisched.sched.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:llama3-1b")
    ap.add_argument("--backend", default="native")
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_cuda_graph: needs a CUDA GPU")
    kw = dict(
        device="cuda",
        dtype=torch.bfloat16,
        backend=args.backend,
        num_pages=4096,
        page_size=16,
        max_running_requests=max(args.batch),
    )
    off = Engine(args.model, cuda_graph=False, **kw)
    t0 = time.perf_counter()
    on = Engine(off.model, tokenizer=off.tokenizer, cuda_graph=True, **kw)
    capture_s = time.perf_counter() - t0
    engines = {False: off, True: on}
    result = dict(
        model=args.model,
        backend=args.backend,
        gpu=torch.cuda.get_device_name(0),
        capture_s=capture_s,
        buckets=on.runner.cuda_graphs.buckets,
        cases=[],
    )
    print(f"capture: {capture_s:.2f} s for buckets {on.runner.cuda_graphs.buckets}", flush=True)
    vocab = off.cfg.vocab_size
    for b in args.batch:
        g = torch.Generator().manual_seed(b)
        prompts = [torch.randint(3, min(vocab, 30000), (args.prompt_len,), generator=g).tolist() for _ in range(b)]
        sp = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
        for eng in engines.values():
            eng.generate(prompts[:1], SamplingParams(max_new_tokens=2, ignore_eos=True))  # warm-up
        runs: dict = {False: [], True: []}
        tokens: dict = {}
        for r in range(args.rounds):
            for graph in (False, True) if r % 2 == 0 else (True, False):
                eng = engines[graph]
                eng.scheduler.flush_cache()
                torch.cuda.synchronize()
                t = time.perf_counter()
                outs = eng.generate(prompts, sp)
                torch.cuda.synchronize()
                wall = time.perf_counter() - t
                runs[graph].append(sum(len(o.token_ids) for o in outs) / wall)
                tokens[graph] = [o.token_ids for o in outs]
        pairs = [(x, y) for a, c in zip(tokens[False], tokens[True]) for x, y in zip(a, c)]
        same = sum(x == y for x, y in pairs) / max(1, len(pairs))
        first_same = all(a[:1] == c[:1] for a, c in zip(tokens[False], tokens[True]))
        med = {k: statistics.median(v) for k, v in runs.items()}
        case = dict(
            batch=b,
            tok_s_off=med[False],
            tok_s_on=med[True],
            ratio=med[True] / med[False],
            same_token_share=same,
            first_tokens_equal=first_same,
        )
        result["cases"].append(case)
        print(
            f"B={b:3d}  eager {med[False]:9.1f} tok/s  graphs {med[True]:9.1f} tok/s  on/off {case['ratio']:.2f}"
            f"  same tokens {same:.1%}  first tokens equal {first_same}",
            flush=True,
        )
    result["replays"] = on.runner.cuda_graphs.num_replays
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
