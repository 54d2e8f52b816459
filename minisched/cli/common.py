"""What every subcommand shares: the one-line CLIError, engine and sampling options, engine construction."""

from __future__ import annotations

import argparse

from minisched.base.flags import Flag, add_flags, flag_names, flag_values, given_flag_values, name_fields
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
        "scheduling flags given override it",
    )
    add_flags(group, config.scheduler)


# `generate` and `chat`'s sampling options: SamplingParams' fields, whose defaults they are (the Python API's,
# greedy; the HTTP routes' defaults are serve/entry.py's), in --help's order
SAMPLING_FLAGS = {
    "max_new_tokens": Flag("tokens to generate at most per request"),
    "temperature": Flag("0 is greedy"),
    "top_k": Flag("sample from the k most likely tokens (-1: all)"),
    "top_p": Flag("nucleus sampling mass, in (0, 1]"),
    "seed": Flag("per-request sampling seed, in [0, 2**64)", type=int),
    "stop": Flag("stop string (repeatable)", type=str),
    "ignore_eos": Flag("keep generating past the end-of-sequence token"),
}


def sampling_args(p: argparse.ArgumentParser) -> None:
    add_flags(p.add_argument_group("sampling"), SamplingParams(), flags=SAMPLING_FLAGS)


def check_output_path(path: str | None, what: str) -> None:
    """Fail before a run, not after it: the folder must exist and the file be writable."""
    problem = unwritable(path)
    if problem:
        raise CLIError(f"{what} {path}: {problem}")


def engine_config(args):
    """The one EngineConfig of a command, from its engine options (CLIError on a bad value). A profile's
    values stand where the user typed no flag: the defaults, then the profile, then what was typed."""
    from minisched.engine.config import EngineConfig
    from minisched.sched.config import PRESETS, SchedulerConfig

    profile = PRESETS[getattr(args, "sched_profile", "default")]
    sched = {**flag_values(args, SchedulerConfig), **profile, **given_flag_values(args, SchedulerConfig)}
    try:
        return EngineConfig().with_options(**flag_values(args, EngineConfig), **sched)
    except ValueError as exc:
        raise CLIError(name_flags(str(exc))) from exc


def name_flags(message: str) -> str:
    """A config's error message with its field names replaced by the flags that set them."""
    from minisched.engine.config import EngineConfig
    from minisched.sched.config import SchedulerConfig

    # field names that are not also plain words of the messages ("model", "device", "backend", ...)
    flags = {k: v for k, v in flag_names(EngineConfig, SchedulerConfig).items() if "_" in k or k in ("tp", "quantize")}
    flags["tensor parallelism"] = "--tp"
    return name_fields(message.removeprefix("SchedulerConfig: "), flags)


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
    try:
        return SamplingParams(**{**flag_values(args, SamplingParams, flags=SAMPLING_FLAGS), **(overrides or {})})
    except ValueError as exc:
        raise CLIError(str(exc)) from exc
