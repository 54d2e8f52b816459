"""TP=2 on the families' tiny models (tests/helpers/families.py): greedy tokens equal transformers', with each
rank holding its share of Qwen2's q/k/v biases, Qwen3's replicated q/k norms and RoPE's frequencies from the
config (Llama-3's scaling); KV heads split (4:2, 4:4) or replicated (Llama-3's 4:1). This process is rank 0
and spawns rank 1 (gloo on the CPU), as tests/parallel/test_tp.py.

Llama-3 runs from its GGUF file (Q/K rows unpermuted and rope_freqs read on every rank), the others from
their HF folders. The partial sums after O and down are added by an all-reduce, so logits differ from one
process in the last bits; greedy tokens stay transformers'.
"""

from __future__ import annotations

import pytest
import torch

from helpers import families as F
from minisched.engine import Engine
from minisched.parallel import ModelSource, TPSession
from minisched.sched.sampling_params import SamplingParams

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "def f(x):\n    return x * 2"]
N_NEW = 8


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "mistral", "llama3"])
def family_tp(request, tmp_path_factory):
    fam = F.build(request.param, tmp_path_factory.mktemp(request.param))
    spec = fam.gguf_path if request.param == "llama3" else fam.hf_dir
    threads = torch.get_num_threads()
    session = TPSession.start(2, ModelSource(spec), timeout=30, startup_timeout=300)
    try:
        yield fam, session
    finally:
        session.close()
        torch.set_num_threads(threads)
    assert [p.exitcode for p in session.procs] == [0]


def test_tp2_greedy_equals_transformers(family_tp):
    fam, session = family_tp
    prompts = [
        list(
            fam.hf_tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)[
                "input_ids"
            ]
        )
        for q in QUESTIONS
    ]
    engine = Engine(tp_session=session, page_size=4, chunk_size=16)
    kv = fam.model.config.num_key_value_heads
    assert engine.kv_cache.shape[-2] == max(1, kv // 2)  # rank 0's pool holds its KV heads
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=N_NEW, ignore_eos=True))
    for o, p in zip(outs, prompts):
        assert o.error is None, o.error
        assert o.token_ids == F.hf_greedy(fam.model, p, N_NEW), f"prompt {o.index}"
