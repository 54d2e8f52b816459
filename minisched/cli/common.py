"""What every subcommand shares: the one-line CLIError, engine and sampling options, engine construction."""
from __future__ import annotations

import argparse

from minisched.sched.req import SamplingParams

SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed", "max_new_tokens", "stop", "stop_token_ids", "ignore_eos")


class CLIError(Exception):
    pass


def engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="'smollm2' (default), a .gguf file, an HF safetensors dir, dummy:<preset>")
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    g.add_argument("--backend", default="auto", choices=["auto", "native", "triton", "torch"])
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--num-pages", type=int, default=None)
    g.add_argument("--mem-fraction", type=float, default=None)
    g.add_argument("--policy", default="fcfs", choices=["fcfs", "lpm", "dfs-weight", "lof"])
    g.add_argument("--chunk-size", type=int, default=512)
    g.add_argument("--max-running-requests", type=int, default=64)
    g.add_argument("--no-radix-cache", action="store_true")
    g.add_argument("--mixed-chunk", action="store_true")
    g.add_argument("--cascade", action="store_true", help="cascade decode for requests sharing prefix pages")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def make_engine(args):
    import torch

    from minisched.engine import Engine
    from minisched.model.weights import ModelNotFound

    dtype = getattr(torch, args.dtype) if args.dtype else None
    try:
        return Engine(args.model, device=args.device, dtype=dtype, backend=args.backend, page_size=args.page_size,
                      num_pages=args.num_pages, mem_fraction=args.mem_fraction, policy=args.policy,
                      chunk_size=args.chunk_size or None, max_running_requests=args.max_running_requests,
                      enable_radix_cache=not args.no_radix_cache, enable_mixed_chunk=args.mixed_chunk,
                      cascade=args.cascade, num_threads=args.threads)
    except ModelNotFound as exc:
        raise CLIError(f"model not found: {exc}") from exc
    except (ValueError, RuntimeError) as exc:
        raise CLIError(str(exc)) from exc


def sampling_from(args, overrides: dict | None = None) -> SamplingParams:
    base = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                max_new_tokens=args.max_new_tokens, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    base.update(overrides or {})
    try:
        return SamplingParams(**base)
    except ValueError as exc:
        raise CLIError(str(exc)) from exc


def make_engine_like(engine, args, enable_radix_cache: bool):
    """A fresh engine (empty cache) on the same loaded model."""
    from minisched.engine import Engine

    return Engine(engine.model, tokenizer=engine.tokenizer, backend=args.backend, page_size=args.page_size,
                  num_pages=engine.sched_config.num_pages, policy=args.policy, chunk_size=args.chunk_size or None,
                  max_running_requests=args.max_running_requests, enable_radix_cache=enable_radix_cache,
                  enable_mixed_chunk=args.mixed_chunk, cascade=args.cascade)
