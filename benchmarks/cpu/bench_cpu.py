"""CPU serving speed of SmolLM2-135M -- not a test.

    python benchmarks/cpu/bench_cpu.py speed [--batch 1 8 32 64] [--busy 1] [--threads N] [--json out.json]
    python benchmarks/cpu/bench_cpu.py profile [--batch 1 8 32 64] [--json out.json]
    python benchmarks/cpu/bench_cpu.py compare --tree base=/tmp/base-wt --tree new=. --rounds 2 [speed options]
    python benchmarks/cpu/bench_cpu.py model-ab --base-tree /tmp/base-wt [--batch ...] [--rounds 10]

`speed`: for each batch size B, B prompts of --prompt-len tokens run to --new-tokens greedy
tokens each (ignore_eos); reports output tok/s over the whole generate (prefill included), the
decode-only tok/s (decode steps' wall time) and prefill tok/s of one --prefill-len prompt.
`--busy K` starts K competing busy-loop processes (`while True: pass`, pinned nowhere) for the
measurement: the shared-laptop case. `--engine-kw key=value` passes engine options (num_threads=2);
`--engine-kw cpu_isa=avx2` runs the CPU kernels as that ISA variant (ops.set_cpu_isa), e.g. an
AVX2-only machine's speed on an AVX-512 one (`compare --tree avx2=.:kw.cpu_isa=avx2 --tree best=.`).

`profile`: torch.profiler over one decode step and one prefill step per batch size: time per op
(self CPU), per layer, and the share outside kernels (Python + dispatch).

`compare`: one persistent worker process per source tree (`--tree name=path[:VAR=value,kw.opt=value,...]`,
PYTHONPATH=path, extra environment and engine options), each loading the model once; short runs alternate between
them (A, B, B, A, ...) for --rounds rounds per batch size, medians reported -- so that versions
of the code see the same machine load. A tree needs its built extension (minisched/ops/_C*.so):
for a worktree of an older commit with the same C++ sources, copy main's.

`model-ab`: one process, one set of weights, two versions of `LlamaModel.forward` (this tree's
and the one in --base-tree's minisched/model/llama.py), alternated every --ab-steps decode steps
(and every prefill) for --rounds rounds: the finest interleaving, for a machine whose load
changes by the second. Reports the median step time of each and the ratio.

The machine is shared: every result carries /proc/loadavg before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def start_busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop_busy(procs) -> None:
    for p in procs:
        p.kill()
        p.wait()


def parse_kw(items) -> dict:
    out = {}
    for item in items or []:
        k, v = item.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def make_engine(args):
    from minisched.engine import Engine

    kw = parse_kw(args.engine_kw)
    if args.threads:
        kw["num_threads"] = args.threads
    isa = kw.pop("cpu_isa", None)  # not an engine option: the process-wide kernel variant (ops.set_cpu_isa)
    if isa:
        from minisched import ops

        ops.set_cpu_isa(isa)
    return Engine("smollm2", **kw)


def prompts_of(engine, batch: int, length: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    # distinct random prompts (no radix-cache sharing); ids from the ordinary-token range
    return [rng.integers(100, engine.cfg.vocab_size - 100, size=length).tolist() for _ in range(batch)]


def run_speed(args) -> dict:
    import torch

    from minisched.sched.sampling_params import SamplingParams

    engine = make_engine(args)
    sp = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    engine.generate(prompts_of(engine, 2, 16, seed=99), SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm
    busy = start_busy(args.busy)
    rows = []
    try:
        time.sleep(0.5 if args.busy else 0)
        for b in args.batch:
            la0 = loadavg()
            engine.step_times.clear()
            n0 = engine.runner.num_forwards
            t = time.perf_counter()
            outs = engine.generate(prompts_of(engine, b, args.prompt_len, seed=b), sp)
            wall = time.perf_counter() - t
            ntok = sum(len(o.token_ids) for o in outs)
            steps = engine.step_times
            # decode steps: the last new_tokens - 1 steps of a batch that prefilled together
            dec = [e - s for s, e in steps[-(args.new_tokens - 1) :]] if args.new_tokens > 1 else []
            dec_tps = b * len(dec) / sum(dec) if dec else None
            rows.append(
                dict(
                    batch=b,
                    out_tok_s=ntok / wall,
                    decode_tok_s=dec_tps,
                    wall_s=wall,
                    tokens=ntok,
                    steps=engine.runner.num_forwards - n0,
                    loadavg_before=la0,
                    loadavg_after=loadavg(),
                )
            )
            print(
                f"  B={b:3d} out {ntok / wall:7.1f} tok/s  decode {dec_tps or 0:7.1f} tok/s  ({wall:.2f}s, load {la0})",
                file=sys.stderr,
                flush=True,
            )
        prefill = None
        if args.prefill_len:
            ids = prompts_of(engine, 1, args.prefill_len, seed=7)
            t = time.perf_counter()
            engine.generate(ids, SamplingParams(max_new_tokens=1, ignore_eos=True))
            dt = time.perf_counter() - t
            prefill = dict(tokens=args.prefill_len, tok_s=args.prefill_len / dt, s=dt)
            print(f"  prefill {args.prefill_len} tokens: {args.prefill_len / dt:.0f} tok/s", file=sys.stderr)
    finally:
        stop_busy(busy)
    return dict(
        rows=rows,
        prefill=prefill,
        busy=args.busy,
        torch_threads=torch.get_num_threads(),
        engine_kw=parse_kw(args.engine_kw),
        threads=args.threads,
    )


# -- profile ----------------------------------------------------------------------------------------


def run_profile(args) -> dict:
    from torch.profiler import ProfilerActivity, profile, record_function

    from minisched.sched.sampling_params import SamplingParams

    engine = make_engine(args)
    # per-layer labels: wrap each layer's body by patching record_function around the loop is not
    # possible without editing the model, so time the layers through profiler events of the linear
    # ops in order instead: ops are grouped by layer index via a forward pre-hook-free counter.
    results = {}
    for b in args.batch:
        for phase in ("decode", "prefill"):
            plen = args.prompt_len if phase == "decode" else args.prefill_len // max(1, min(b, 8))
            nb = b if phase == "decode" else min(b, 8)
            prompts = prompts_of(engine, nb, plen, seed=b)
            sp = SamplingParams(max_new_tokens=4 if phase == "decode" else 1, ignore_eos=True)
            for p in prompts:
                engine.add_request(p, sp)
            # prefill step(s) then a decode step; profile the step of the phase
            if phase == "decode":
                while engine.runner.num_forwards == 0 or not _all_prefilled(engine):
                    engine.step()
                for _ in range(2):  # warm decode
                    engine.step()
            with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
                with record_function("step"):
                    t = time.perf_counter()
                    engine.step()
                    wall = time.perf_counter() - t
            while engine.has_work():
                engine.step()
            results[f"{phase} B={b}"] = summarize(prof, wall, nb, plen, phase)
            r = results[f"{phase} B={b}"]
            print(
                f"{phase} B={nb} ({plen} tok prompts): {wall * 1e3:.1f} ms; kernels {r['kernel_ms']:.1f} ms, "
                f"outside {r['other_ms']:.1f} ms",
                file=sys.stderr,
                flush=True,
            )
            for name, ms, cnt in r["top"][:12]:
                print(f"    {name:45s} {ms:8.2f} ms  x{cnt}", file=sys.stderr)
    return results


def _all_prefilled(engine) -> bool:
    sched = engine.scheduler
    return bool(sched.running) and not sched.waiting and all(r.output_ids for r in sched.running)


def summarize(prof, wall: float, batch: int, plen: int, phase: str) -> dict:
    per = defaultdict(lambda: [0.0, 0])
    for e in prof.key_averages():
        if e.key == "step":
            continue
        per[e.key][0] += e.self_cpu_time_total / 1e3
        per[e.key][1] += e.count
    total_self = sum(v[0] for v in per.values())
    top = sorted(((k, v[0], v[1]) for k, v in per.items()), key=lambda x: -x[1])
    return dict(
        wall_ms=wall * 1e3,
        batch=batch,
        prompt_len=plen,
        phase=phase,
        kernel_ms=total_self,
        other_ms=wall * 1e3 - total_self,
        top=top[:25],
    )


# -- model-ab ---------------------------------------------------------------------------------------


def run_model_ab(args) -> dict:
    import importlib.util
    import statistics
    import types

    from minisched.sched.sampling_params import SamplingParams

    spec = importlib.util.spec_from_file_location(
        "base_llama", os.path.join(args.base_tree, "minisched/model/llama.py")
    )
    base = importlib.util.module_from_spec(spec)
    sys.modules["base_llama"] = base  # dataclasses look their module up
    spec.loader.exec_module(base)
    engine = make_engine(args)
    model = engine.model
    versions = {
        "base": (types.MethodType(base.LlamaModel.forward, model), types.MethodType(base.LlamaModel._attention, model)),
        "new": (None, None),
    }

    def use(name):
        fwd, att = versions[name]
        for attr, fn in (("forward", fwd), ("_attention", att)):
            if fn is None:
                model.__dict__.pop(attr, None)
            else:
                model.__dict__[attr] = fn

    out = {}
    for b in args.batch:
        times = {"base": [], "new": []}
        sp = SamplingParams(max_new_tokens=10_000, ignore_eos=True)
        for p in prompts_of(engine, b, args.prompt_len, seed=b):
            engine.add_request(p, sp)
        while not _all_prefilled(engine):
            engine.step()
        la0 = loadavg()
        for r in range(args.rounds):
            for name in ("base", "new") if r % 2 == 0 else ("new", "base"):
                use(name)
                for _ in range(args.ab_steps):
                    t = time.perf_counter()
                    engine.step()
                    times[name].append(time.perf_counter() - t)
        use("new")
        for req in list(engine.scheduler.running) + list(engine.scheduler.waiting):
            engine.abort(req.rid)
        while engine.has_work():
            engine.step()
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        out[f"decode B={b}"] = dict(
            base_ms=med["base"],
            new_ms=med["new"],
            speedup=med["base"] / med["new"],
            steps=len(times["new"]),
            loadavg_before=la0,
            loadavg_after=loadavg(),
        )
        print(
            f"decode B={b:3d}: base {med['base']:7.2f} ms/step  new {med['new']:7.2f}  "
            f"x{med['base'] / med['new']:.3f}  (load {la0})",
            file=sys.stderr,
            flush=True,
        )
    if args.prefill_len:
        times = {"base": [], "new": []}
        la0 = loadavg()
        for r in range(max(2, args.rounds // 2)):
            for name in ("base", "new") if r % 2 == 0 else ("new", "base"):
                use(name)
                ids = prompts_of(engine, 1, args.prefill_len, seed=1000 + r * 2 + (name == "new"))
                t = time.perf_counter()
                engine.generate(ids, SamplingParams(max_new_tokens=1, ignore_eos=True))
                times[name].append(time.perf_counter() - t)
        use("new")
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        out[f"prefill {args.prefill_len}"] = dict(
            base_ms=med["base"],
            new_ms=med["new"],
            speedup=med["base"] / med["new"],
            loadavg_before=la0,
            loadavg_after=loadavg(),
        )
        print(
            f"prefill {args.prefill_len}: base {med['base']:7.1f} ms  new {med['new']:7.1f}  "
            f"x{med['base'] / med['new']:.3f}  (load {la0})",
            file=sys.stderr,
            flush=True,
        )
    return out


# -- compare ----------------------------------------------------------------------------------------
# Persistent workers, one per source tree, each with its engine loaded once; the driver alternates
# short runs between them (A, B, B, A, ...) so both see the same load, which on a shared machine
# changes by the second. A worker reads {"batch", "new", "prompt_len"} lines and answers with its
# output tok/s and decode-only tok/s.


def worker_main(args) -> None:
    import torch

    from minisched.sched.sampling_params import SamplingParams

    engine = make_engine(args)
    engine.generate(prompts_of(engine, 2, 16, seed=99), SamplingParams(max_new_tokens=4, ignore_eos=True))
    print(
        json.dumps(
            {
                "ready": True,
                "threads": torch.get_num_threads(),
                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                "quantize": getattr(getattr(engine, "quant", None), "mode", None),  # as resolved (auto: gguf or none)
            }
        ),
        flush=True,
    )
    for line in sys.stdin:
        req = json.loads(line)
        b, new = req["batch"], req["new"]
        engine.step_times.clear()
        t = time.perf_counter()
        outs = engine.generate(
            prompts_of(engine, b, req["prompt_len"], seed=req["seed"]),
            SamplingParams(max_new_tokens=new, ignore_eos=True),
        )
        wall = time.perf_counter() - t
        ntok = sum(len(o.token_ids) for o in outs)
        dec = [e - s for s, e in engine.step_times[-(new - 1) :]] if new > 1 else []
        print(
            json.dumps(
                {
                    "out_tok_s": ntok / wall,
                    "decode_tok_s": b * len(dec) / sum(dec) if dec else None,
                    "prompt_tok_s": b * req["prompt_len"] / wall if new == 1 else None,
                }
            ),
            flush=True,
        )


def run_compare(args, passthrough: list[str]) -> dict:
    import statistics

    trees = [t.split("=", 1) for t in args.tree]
    workers = {}
    for name, path in trees:
        path, _, extra = path.partition(":")  # name=path[:VAR=value,...,kw.key=value,...]
        env = dict(os.environ, PYTHONPATH=os.path.abspath(path))
        kws = []
        for kv in filter(None, extra.split(",")):
            k, v = kv.split("=", 1)
            if k.startswith("kw."):
                kws += ["--engine-kw", f"{k[3:]}={v}"]
            else:
                env[k] = v
        envs = extra
        cmd = [sys.executable, os.path.join(HERE, "bench_cpu.py"), "worker"] + passthrough + kws
        proc = subprocess.Popen(
            cmd, env=env, cwd=os.path.abspath(path), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        info = json.loads(proc.stdout.readline())
        print(f"worker {name}: {path} {envs or ''} {info}", file=sys.stderr, flush=True)
        workers[name] = proc
    cases = [(b, args.new_tokens) for b in args.batch] + ([(1, 1)] if args.prefill_len else [])
    busy = start_busy(args.busy)
    samples = []
    try:
        for b, new in cases:
            plen = args.prompt_len if new > 1 else args.prefill_len
            for r in range(args.rounds):
                order = list(workers) if r % 2 == 0 else list(workers)[::-1]
                for name in order:
                    proc = workers[name]
                    la = loadavg()
                    proc.stdin.write(json.dumps({"batch": b, "new": new, "prompt_len": plen, "seed": r}) + "\n")
                    proc.stdin.flush()
                    res = json.loads(proc.stdout.readline())
                    res.update(tree=name, batch=b, new=new, round=r, loadavg=la)
                    samples.append(res)
            label = f"B={b}" if new > 1 else f"prefill {plen}"
            for name in workers:
                key = "out_tok_s" if new > 1 else "prompt_tok_s"
                v = [x[key] for x in samples if x["tree"] == name and x["batch"] == b and x["new"] == new]
                print(
                    f"{label:12s} {name:10s} median {statistics.median(v):7.1f} tok/s  "
                    f"({min(v):.1f}-{max(v):.1f}, {len(v)} runs)",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        stop_busy(busy)
        for proc in workers.values():
            proc.stdin.close()
            proc.wait()
    return dict(samples=samples, trees=args.tree, busy=args.busy)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cmd", choices=["speed", "profile", "compare", "model-ab", "worker"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--busy", type=int, default=0, help="competing busy-loop processes during the run")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--engine-kw", action="append", default=[], help="key=value engine option (JSON value)")
    p.add_argument("--json", default=None, help="write results here ('-': stdout)")
    p.add_argument("--tree", action="append", default=[], help="compare: name=path of a source tree")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--base-tree", default=None, help="model-ab: the tree whose llama.py is the baseline")
    p.add_argument("--ab-steps", type=int, default=3, help="model-ab: decode steps per turn")
    args, rest = p.parse_known_args(argv)
    if args.cmd == "compare":
        passthrough = [a for a in argv if a not in ("compare",)]
        # drop compare-only options from what the children get
        clean, skip = [], False
        for a in passthrough:
            if skip:
                skip = False
                continue
            if a in ("--tree", "--rounds", "--json", "--busy"):
                skip = True
                continue
            clean.append(a)
        res = run_compare(args, clean)
    else:  # a compare worker imports its tree's minisched through PYTHONPATH (run_compare sets it)
        if args.cmd == "worker":
            return worker_main(args)
        run = {"speed": run_speed, "profile": run_profile, "model-ab": run_model_ab}[args.cmd]
        res = run(args)
    res = (
        dict(cmd=args.cmd, loadavg_end=loadavg(), argv=argv, result=res)
        if args.cmd != "compare"
        else dict(cmd="compare", loadavg_end=loadavg(), argv=argv, **res)
    )
    if args.json == "-":
        print(json.dumps(res["result"] if args.cmd != "compare" else res))
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
