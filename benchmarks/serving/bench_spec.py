"""Speculative decoding with the n-gram (prompt lookup) drafter, in process -- not a test.

    python benchmarks/serving/bench_spec.py [--model smollm2] [--batch 1 8] [--rounds 3] [--json out.json]

Two workloads of chat prompts, greedy, up to --new-tokens tokens (EOS ends a request):

- grounded: "repeat / correct / copy this passage" over paragraphs of this repository's docs -- the
  output copies the input, where prompt lookup pays;
- chat: open questions, where the output rarely repeats the prompt (drafting must not cost).

For each workload and batch size B (the first B prompts), engines on the same weights -- no drafting,
and `speculative="ngram"` with each --num-draft-tokens, every draft verified (`spec_cost_model=False`;
with --cost-model also with the step-cost model deciding which drafts pay, the default,
sched/spec_cost.py) -- run alternately (A, B, B, A, ...) for
--rounds rounds, cache-cold each time. Per run: output tok/s of the whole run (prefill included) and
of its decode phase (tokens after each request's first / from the first token to the last finish), engine steps,
output tokens per decode-phase step (tokens / steps after the prefill), acceptance rate (accepted /
drafted), verify steps. Medians go to stdout and --json, with the median of the per-round tok/s
ratios against no drafting and /proc/loadavg before and after. Greedy tokens are compared across the
variants (identical by construction; the check keeps a speedup from hiding a bug).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

from minisched.base.cpus import loadavg
from minisched.engine import Engine
from minisched.sched.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = [
    "Write a short story about a robot who learns to paint.",
    "What are three good habits for staying healthy? Explain each briefly.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me some ideas for a birthday party for my grandmother.",
    "What is the difference between a virus and a bacterium?",
    "Write a polite email asking my landlord to fix the heating.",
    "How do airplanes stay in the air?",
    "Suggest a weekend itinerary for a first visit to Rome.",
]
TASKS = [
    "Repeat the following passage exactly, word for word:",
    "Copy the following text and fix any spelling mistakes:",
    "Rewrite the following passage exactly as it is, keeping every sentence:",
]


def passages(n: int) -> list[str]:
    """Prose paragraphs (no code, tables or lists) of the README and docs/*.md, 250-700 characters each."""
    out = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for para in path.read_text().split("\n\n"):
            para = " ".join(para.split())
            if 250 <= len(para) <= 700 and not re.match(r"[#|`\-*>0-9]", para):
                out.append(para)
    if len(out) < n:
        raise SystemExit(f"only {len(out)} passages in README.md and docs/")
    return out[:n]


def workloads(n: int) -> dict[str, list]:
    grounded = [[{"role": "user", "content": f"{TASKS[i % len(TASKS)]}\n\n{p}"}] for i, p in enumerate(passages(n))]
    chat = [[{"role": "user", "content": q}] for q in (QUESTIONS * n)[:n]]
    return {"grounded": grounded, "chat": chat}


def one_run(engine: Engine, prompts: list, sp: SamplingParams) -> dict:
    sched = engine.scheduler
    sched.flush_cache()  # cache-cold: every run computes the same
    sched.drain_records()
    before = sched.snapshot().spec
    t0 = time.perf_counter()
    reqs = [engine.add_request(p, sp) for p in prompts]
    while engine.has_work():
        engine.step()
    wall = time.perf_counter() - t0
    outs = [engine.output_of(r) for r in reqs]
    first = min(r.first_token_time for r in reqs)
    decode_wall = max(r.finish_time for r in reqs) - first
    stats = sched.records().step_stats
    tokens = sum(len(o.token_ids) for o in outs)
    decode_steps = sum(1 for s in stats if s.mode in ("decode", "verify", "mixed"))
    first_tokens = len(outs)  # each request's first token comes from its prefill
    res = dict(
        wall=wall,
        tok_s=tokens / wall,
        decode_tok_s=(tokens - len(outs)) / decode_wall if decode_wall > 0 else 0.0,
        tokens=tokens,
        steps=len(stats),
        tokens_per_step=(tokens - first_tokens) / max(1, decode_steps),
        acceptance=0.0,
        verify_steps=0,
        ids=[o.token_ids for o in outs],
    )
    spec = sched.snapshot().spec
    if spec is not None:
        drafted = spec.draft_tokens - before.draft_tokens
        res["acceptance"] = (spec.accepted_tokens - before.accepted_tokens) / drafted if drafted else 0.0
        res["verify_steps"] = spec.verify_steps - before.verify_steps
        res["drafted"] = drafted
        res["declined"] = spec.declined_tokens - before.declined_tokens
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--num-draft-tokens", nargs="+", type=int, default=[4, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workload", nargs="+", default=["grounded", "chat"])
    ap.add_argument("--threads", type=int, default=None, help="Engine num_threads (default: tuned)")
    ap.add_argument(
        "--cost-model",
        action="store_true",
        help="also run each k with the step-cost model (the default; drafts cut to what it expects to pay), "
        "as 'ngram k=K cost'",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    result = dict(loadavg_before=loadavg(), args=vars(args), cases=[])
    base = Engine(args.model, num_threads=args.threads)
    result["quantize"] = base.quant.mode  # as resolved (the default, auto: gguf for SmolLM2); fresh() keeps it
    print(f"{args.model}: quantize {base.quant.mode}, backend {base.backend}", flush=True)
    variants = {"off": base}
    for k in args.num_draft_tokens:
        # every draft verified (--no-spec-cost-model)
        variants[f"ngram k={k}"] = base.fresh(
            speculative="ngram", num_draft_tokens=k, num_threads=args.threads, spec_cost_model=False
        )
        if args.cost_model:  # the same drafts, cut to what the step-cost model expects to pay (the default)
            variants[f"ngram k={k} cost"] = base.fresh(
                speculative="ngram", num_draft_tokens=k, num_threads=args.threads, spec_cost_model=True
            )
    names = list(variants)
    wl = workloads(max(args.batch))
    sp = SamplingParams(max_new_tokens=args.new_tokens)
    for eng in variants.values():  # warm-up
        eng.generate(wl["chat"][:1], SamplingParams(max_new_tokens=4))
    for w in args.workload:
        for b in args.batch:
            prompts = [base.encode(m) for m in wl[w][:b]]
            runs: dict[str, list] = {n: [] for n in names}
            for r in range(args.rounds):
                for n in names if r % 2 == 0 else names[::-1]:
                    runs[n].append(one_run(variants[n], prompts, sp))
            same = all(x["ids"] == runs["off"][0]["ids"] for n in names for x in runs[n])
            case = dict(workload=w, batch=b, same_tokens=same, variants={})
            for n in names:
                med = {
                    k: statistics.median(x[k] for x in runs[n])
                    for k in (
                        "wall",
                        "tok_s",
                        "decode_tok_s",
                        "tokens",
                        "steps",
                        "tokens_per_step",
                        "acceptance",
                        "verify_steps",
                    )
                }
                med["round_speedups"] = [x["tok_s"] / y["tok_s"] for x, y in zip(runs[n], runs["off"])]
                med["speedup"] = statistics.median(med["round_speedups"])
                med["decode_speedup"] = statistics.median(
                    x["decode_tok_s"] / y["decode_tok_s"] for x, y in zip(runs[n], runs["off"])
                )
                case["variants"][n] = med
                print(
                    f"{w:9s} B={b:2d} {n:10s} {med['tok_s']:7.1f} tok/s  x{med['speedup']:.2f}  decode "
                    f"{med['decode_tok_s']:7.1f} tok/s  x{med['decode_speedup']:.2f}  "
                    f"{med['tokens_per_step']:.2f} tok/step  accept {med['acceptance']:.2f}  "
                    f"verify {med['verify_steps']:.0f}/{med['steps']:.0f} steps  ({med['tokens']:.0f} tokens)",
                    flush=True,
                )
            print(f"{w:9s} B={b:2d} same greedy tokens across variants: {same}", flush=True)
            result["cases"].append(case)
    result["loadavg_after"] = loadavg()
    print(f"loadavg before {result['loadavg_before']} after {result['loadavg_after']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
