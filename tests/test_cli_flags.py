"""The engine options are generated from the config fields (base/flags.py): every flag the command line
had stays, with its default; values travel back to the one EngineConfig, command-line spellings undone."""

from __future__ import annotations

import argparse

import pytest

from minisched.cli.common import CLIError, engine_args, engine_config
from minisched.engine.config import EngineConfig

# every engine option of the command line before the flags were generated (names stay)
FLAGS = """--model --device --dtype --backend --page-size --num-pages --mem-fraction --max-context-len --policy
--chunk-size --max-running-requests --no-radix-cache --mixed-chunk --cascade --threads --tp --tp-timeout
--quantize --pack-weights --no-pack-weights --host-kv-pages --host-kv-write-through --priority-scheduling
--priority-preemption-threshold --priority-aging-steps --speculative --draft-model --num-draft-tokens
--spec-max-batch-size --spec-adaptive --no-spec-adaptive --ngram-min-match --ngram-max-match --overlap
--no-overlap --cuda-graph --no-cuda-graph --grammar-compile-timeout""".split()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    engine_args(p)
    return p


def test_every_flag_is_there():
    usage = parser().format_help()
    missing = [f for f in FLAGS if f"{f} " not in usage and f"{f}," not in usage and f"{f}\n" not in usage]
    assert not missing


def test_defaults_are_the_configs():
    assert engine_config(parser().parse_args([])) == EngineConfig(model="smollm2")


def test_values_reach_the_config():
    args = parser().parse_args(
        "--chunk-size 0 --no-radix-cache --mixed-chunk --priority-preemption-threshold -1 --priority-aging-steps 0 "
        "--threads 3 --no-spec-adaptive --overlap --no-pack-weights --policy lpm --dtype bfloat16 "
        "--max-running-requests 7 --max-prefill-tokens 256 --speculative ngram --grammar-compile-timeout 2.5".split()
    )
    cfg = engine_config(args)
    s = cfg.scheduler
    assert (s.chunk_size, s.enable_radix_cache, s.enable_mixed_chunk) == (None, False, True)
    assert (s.priority_preemption_threshold, s.priority_aging_steps, s.spec_adaptive) == (None, None, False)
    assert (s.policy, s.max_running_requests, s.max_prefill_tokens) == ("lpm", 7, 256)
    assert (cfg.num_threads, cfg.overlap, cfg.pack_weights, cfg.dtype) == (3, True, False, "bfloat16")
    assert cfg.speculative == "ngram" and cfg.grammar_compile_timeout == 2.5


def test_choices_come_from_the_owners():
    from minisched.sched.policy import POLICIES
    from minisched.sched.spec import SPECULATIVE

    help_text = parser().format_help()
    assert "{" + ",".join(POLICIES) + "}" in help_text
    assert "{" + ",".join(SPECULATIVE) + "}" in help_text
    with pytest.raises(SystemExit):
        parser().parse_args(["--policy", "random"])


def test_quantize_auto_is_the_default():
    """--quantize auto: in the choices, the default, its help says what it picks and why; with --tp no error
    (it resolves to none there: engine/options.py pick_quantize)."""
    from minisched.engine.config import QUANTIZE_CHOICES

    help_text = " ".join(parser().format_help().split())
    assert QUANTIZE_CHOICES[0] == "auto" and "{" + ",".join(QUANTIZE_CHOICES) + "}" in help_text
    assert "auto (the default): gguf" in help_text and "same bits as fp32" in help_text
    # --no-pack-weights asks for plain float32: auto is none then; explicit gguf keeps its blocks
    assert "no --no-pack-weights" in help_text and "with --no-pack-weights the blocks still run" in help_text
    assert "--quantize auto resolves to none" in help_text
    assert engine_config(parser().parse_args(["--no-pack-weights"])).quantize == "auto"  # resolved by the engine
    assert engine_config(parser().parse_args([])).quantize == "auto"
    assert engine_config(parser().parse_args(["--quantize", "auto"])) == EngineConfig(model="smollm2")
    assert engine_config(parser().parse_args("--tp 2".split())).quantize == "auto"
    with pytest.raises(CLIError, match="--quantize with --tp"):
        engine_config(parser().parse_args("--tp 2 --quantize gguf".split()))


def test_quantize_choices_are_the_modes():
    """--quantize's choices are auto and model/quant.py's modes, gguf-a8 among them: parsed to the config as
    given (the engine resolves nothing for it), its help says what it trades and that auto never picks it."""
    from minisched.engine.config import QUANTIZE_CHOICES
    from minisched.model.quant import QUANT_MODES

    assert QUANTIZE_CHOICES == ("auto", *QUANT_MODES) and "gguf-a8" in QUANT_MODES
    assert engine_config(parser().parse_args(["--quantize", "gguf-a8"])).quantize == "gguf-a8"
    help_text = " ".join(parser().format_help().split())
    assert "gguf-a8: gguf's blocks with the activations rounded to 8 bits" in help_text
    assert "never picked by auto" in help_text
    with pytest.raises(CLIError, match="--quantize with --tp"):
        engine_config(parser().parse_args("--tp 2 --quantize gguf-a8".split()))
    with pytest.raises(SystemExit):
        parser().parse_args(["--quantize", "a8"])


@pytest.mark.parametrize(
    "argv, flag",
    [
        ("--chunk-size -3", "--chunk-size"),
        ("--max-running-requests 0", "--max-running-requests"),
        ("--tp 0", "--tp"),
        ("--grammar-compile-timeout 0", "--grammar-compile-timeout"),
    ],
)
def test_errors_name_the_flag(argv, flag):
    with pytest.raises(CLIError, match=flag):
        engine_config(parser().parse_args(argv.split()))


# -- what the user typed, and profiles -----------------------------------------------------------------
def test_the_options_typed_are_known_even_at_their_default():
    from minisched.base.flags import given, given_flag_values
    from minisched.sched.config import SchedulerConfig

    args = parser().parse_args("--chunk-size 512 --no-radix-cache --policy fcfs".split())
    assert {"chunk_size", "enable_radix_cache", "policy"} <= given(args)
    assert given_flag_values(args, SchedulerConfig) == {
        "chunk_size": 512,
        "enable_radix_cache": False,
        "policy": "fcfs",
    }
    assert given_flag_values(parser().parse_args([]), SchedulerConfig) == {}


def test_what_the_user_typed_wins_over_a_profile(monkeypatch):
    """A profile's values stand where no flag was typed; a typed flag wins, also at its default value (the
    profile merge used to treat a flag equal to its default as not typed)."""
    from minisched.sched import config

    monkeypatch.setitem(config.PRESETS, "toy", {"chunk_size": 256, "max_running_requests": 8})
    s = engine_config(parser().parse_args("--sched-profile toy --chunk-size 512".split())).scheduler
    assert (s.chunk_size, s.max_running_requests) == (512, 8)
    s = engine_config(parser().parse_args("--sched-profile toy --max-running-requests 64".split())).scheduler
    assert (s.chunk_size, s.max_running_requests) == (256, 64)
    s = engine_config(parser().parse_args("--sched-profile toy".split())).scheduler
    assert (s.chunk_size, s.max_running_requests) == (256, 8)


# -- the sampling options: SamplingParams' fields ------------------------------------------------------
def sampling_parser() -> argparse.ArgumentParser:
    from minisched.cli.common import sampling_args

    p = argparse.ArgumentParser()
    sampling_args(p)
    return p


def test_sampling_defaults_are_sampling_params():
    from minisched.cli.common import sampling_from
    from minisched.sched.sampling_params import SamplingParams

    assert sampling_from(sampling_parser().parse_args([])) == SamplingParams()
    got = sampling_from(
        sampling_parser().parse_args("--stop a --stop bc --seed 7 --temperature 0.5 --ignore-eos".split())
    )
    assert got == SamplingParams(stop=("a", "bc"), seed=7, temperature=0.5, ignore_eos=True)
    with pytest.raises(CLIError, match="top_p"):
        sampling_from(sampling_parser().parse_args(["--top-p", "0"]))


# -- minisched serve's options: ServeConfig ------------------------------------------------------------
def serve_args(argv: list[str]):
    from minisched.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def test_serve_defaults_are_the_configs(monkeypatch):
    from minisched.cli.serve import ServeConfig, serve_config

    monkeypatch.delenv("MINISCHED_API_KEY", raising=False)
    assert serve_config(serve_args([])) == ServeConfig()
    monkeypatch.setenv("MINISCHED_API_KEY", "from-env")
    assert serve_config(serve_args([])).api_key == "from-env"
    cfg = serve_config(
        serve_args(
            "--port 0 --max-stop-chars 9 --router round-robin --router-balance-abs-threshold 3 "
            "--engine-max-restarts 0 --record-keep 2 --record runs/x.json --dp 2".split()
        )
    )
    assert (cfg.port, cfg.dp, cfg.limits.max_stop_chars, cfg.router.policy) == (0, 2, 9, "round-robin")
    assert (cfg.router.balance_abs_threshold, cfg.supervision.max_restarts) == (3, 0)
    assert (cfg.recording.path, cfg.recording.keep) == ("runs/x.json", 2)


def test_the_choice_bound_follows_the_queue():
    """`serve --max-queued-requests 6` used to exit with "--max-choices-per-request must be <=
    --max-queued-requests" though --max-choices-per-request was never typed: its default now follows."""
    from minisched.cli.serve import serve_config
    from minisched.serve.limits import MAX_CHOICES

    assert serve_config(serve_args(["--max-queued-requests", "6"])).limits.choices == 6
    assert serve_config(serve_args(["--max-queued-requests", "0"])).limits.choices == 1
    assert serve_config(serve_args([])).limits.choices == MAX_CHOICES
    assert (
        serve_config(serve_args(["--max-queued-requests", "6", "--max-choices-per-request", "4"])).limits.choices == 4
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            "--max-queued-requests 6 --max-choices-per-request 7",
            "--max-choices-per-request (7) must be <= --max-queued-requests (6)",
        ),
        ("--max-choices-per-request 600", "--max-choices-per-request (600) must be <= --max-queued-requests (512)"),
        ("--max-queued-requests -1", "--max-queued-requests must be an int >= 0"),
        ("--max-logit-bias 0", "--max-logit-bias must be an int >= 1"),
        ("--port 70000", "--port must be in [0, 65535]"),
        ("--grace-period -1", "--grace-period must be >= 0"),
        ("--engine-in-process --dp 2", "--engine-in-process runs one engine: not with --dp"),
        ("--engine-step-timeout 0", "--engine-step-timeout must be > 0"),
        ("--router-balance-rel-threshold 0.5", "--router-balance-rel-threshold must be >= 1"),
        ("--record x.json --record-interval 0", "--record-interval must be > 0"),
    ],
)
def test_bad_serve_options_are_one_line_errors_naming_the_flag(argv, message, capsys):
    from minisched.cli import main

    assert main(["serve", "--model", "dummy:tiny", *argv.split()]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("minisched: error:") and message in err and "\n" not in err, err
