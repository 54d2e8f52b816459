"""SchedulerConfig presets (config.py PRESETS)."""

import pytest

from minisched.sched.config import PRESETS, SchedulerConfig


def test_default_preset_is_the_default_config():
    assert SchedulerConfig.preset("default") == SchedulerConfig()


# The rule options whose default is SGLang 0.5.23's rule (prefill first is also the founding design's): minisched's
# own rule showed no measured win (benchmarks/RESULTS.md, "Scheduler" > "Rules: minisched's vs SGLang's"); the
# preset still sets them all
SGLANG_DEFAULTS = {
    "max_prefill_rounds_between_decodes",
    "max_prefill_tokens_with_chunking",
    "dfs_weight_fallback",
    "dfs_ties_reversed",
    "lru_rule",
}


def test_sglang_preset_runs_prefill_first_and_takes_fields():
    cfg = SchedulerConfig.preset("sglang", page_size=1, policy="lpm")
    assert cfg.max_prefill_rounds_between_decodes is None
    assert (cfg.page_size, cfg.policy) == (1, "lpm")
    assert SchedulerConfig().max_prefill_rounds_between_decodes is None  # the default runs prefill first too
    # every field the preset sets is a real option; its default differs from it except where the default
    # follows SGLang's rule (exactly SGLANG_DEFAULTS)
    default = SchedulerConfig()
    for name, value in PRESETS["sglang"].items():
        assert getattr(cfg, name) == value, name
        assert (getattr(default, name) == value) == (name in SGLANG_DEFAULTS), name
    assert SGLANG_DEFAULTS <= set(PRESETS["sglang"])


def test_rule_options_reject_unknown_values():
    for name in (
        "admission_budget",
        "chunk_rule",
        "in_batch_prefix_rule",
        "retraction_rule",
        "policy_sort",
        "lru_rule",
    ):
        with pytest.raises(ValueError, match=name):
            SchedulerConfig(**{name: "nope"})
    with pytest.raises(ValueError, match="retracted_to_tail"):
        SchedulerConfig(retracted_to_tail=1)


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        SchedulerConfig.preset("nope")
    assert set(PRESETS) == {"default", "sglang"}


def test_cli_sched_profile_sets_the_preset_and_flags_override_it():
    import argparse

    from minisched.cli.common import engine_args, engine_config

    p = argparse.ArgumentParser()
    engine_args(p)
    cfg = engine_config(p.parse_args(["--sched-profile", "sglang", "--page-size", "1"])).scheduler
    assert cfg == SchedulerConfig.preset("sglang", page_size=1, num_pages=None, max_context_len=None)
    cfg = engine_config(p.parse_args(["--sched-profile", "sglang", "--retraction-rule", "minisched"])).scheduler
    # what the user typed wins, even the default value; the rest is the profile's
    assert (cfg.retraction_rule, cfg.admission_budget) == ("minisched", "sglang")
    cfg = engine_config(p.parse_args(["--sched-profile", "sglang", "--chunk-size", "64"])).scheduler
    assert (cfg.chunk_size, cfg.retracted_to_tail) == (64, True)
    assert engine_config(p.parse_args([])).scheduler == SchedulerConfig(num_pages=None, max_context_len=None)
