"""SchedulerConfig presets (config.py PRESETS)."""

import pytest

from minisched.sched.config import PRESETS, SchedulerConfig


def test_default_preset_is_the_default_config():
    assert SchedulerConfig.preset("default") == SchedulerConfig()


def test_sglang_preset_runs_prefill_first_and_takes_fields():
    cfg = SchedulerConfig.preset("sglang", page_size=1, policy="lpm")
    assert cfg.max_prefill_rounds_between_decodes is None
    assert (cfg.page_size, cfg.policy) == (1, "lpm")
    assert SchedulerConfig().max_prefill_rounds_between_decodes == 1  # the default keeps alternating rounds


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        SchedulerConfig.preset("nope")
    assert set(PRESETS) == {"default", "sglang"}
