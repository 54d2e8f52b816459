"""What every subcommand shares: the one-line CLIError, engine and sampling options, engine construction."""

from __future__ import annotations

import argparse

from minisched.base.flags import add_flags, flag_names, flag_values
from minisched.observe.paths import unwritable
from minisched.sched.sampling_params import SamplingParams

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
    """The engine and scheduling options, one per flagged field of EngineConfig and SchedulerConfig
    (base/flags.py): names, help, choices and defaults are the fields'."""
    from minisched.engine.config import EngineConfig
    from minisched.sched.config import PRESETS

    config = EngineConfig()
    add_flags(p.add_argument_group("engine"), config)
    group = p.add_argument_group("scheduling")
    group.add_argument(
        "--sched-profile",
        default="default",
        choices=list(PRESETS),
        help="a scheduler profile (SchedulerConfig.preset): 'sglang' makes SGLang 0.5.23's decisions; "
        "scheduling flags given with a value other than their default override it",
    )
    add_flags(group, config.scheduler)


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
    from minisched.engine.config import EngineConfig
    from minisched.sched.config import PRESETS, SchedulerConfig

    sched = flag_values(args, SchedulerConfig)
    profile = getattr(args, "sched_profile", "default")
    if profile != "default":  # the profile's values, except where a flag was set to something else
        defaults = flag_values(parser_defaults(args), SchedulerConfig)
        sched = {
            **sched,
            **{k: v for k, v in PRESETS[profile].items() if sched.get(k, defaults.get(k)) == defaults.get(k)},
        }
    try:
        return EngineConfig().with_options(**flag_values(args, EngineConfig), **sched)
    except ValueError as exc:
        raise CLIError(name_flags(str(exc))) from exc


def parser_defaults(args):
    """The namespace the engine options would give with no flag set (their defaults)."""
    import argparse

    p = argparse.ArgumentParser()
    engine_args(p)
    return argparse.Namespace(**{**vars(args), **vars(p.parse_args([]))})


def name_flags(message: str) -> str:
    """A config's error message with its field names replaced by the flags that set them."""
    import re

    from minisched.engine.config import EngineConfig
    from minisched.sched.config import SchedulerConfig

    # field names that are not also plain words of the messages ("model", "device", "backend", ...)
    flags = {k: v for k, v in flag_names(EngineConfig, SchedulerConfig).items() if "_" in k or k in ("tp", "quantize")}
    flags["tensor parallelism"] = "--tp"
    message = message.removeprefix("SchedulerConfig: ")
    return re.sub(r"\b(" + "|".join(map(re.escape, flags)) + r")\b", lambda m: flags[m.group(1)], message)


def make_engine(config):
    """The Engine of `config` (under --tp N, rank 0's: it starts the other ranks, or joins torchrun's,
    and stops them at exit)."""
    from minisched.engine import Engine
    from minisched.model.weights import ModelNotFound

    try:
        return Engine(config=config)
    except ModelNotFound as exc:
        raise CLIError(f"model not found: {exc}") from exc
    except (ValueError, RuntimeError, ImportError) as exc:  # TPError is a RuntimeError
        raise CLIError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc


def run_tp_worker(args):
    """Under torchrun, the ranks > 0 of `--tp N` serve rank 0 instead of running the command: returns
    their exit status, or None on rank 0 and without torchrun."""
    import os

    import torch

    if getattr(args, "tp", 1) <= 1 or int(os.environ.get("RANK", "0")) == 0:
        return None
    from minisched.parallel import ModelSource, run_torchrun_worker

    config = engine_config(args)
    return run_torchrun_worker(
        ModelSource(config.model, dtype=getattr(torch, config.resolved_dtype)),
        config.device,
        timeout=config.tp_timeout,
        num_threads=config.num_threads,
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
