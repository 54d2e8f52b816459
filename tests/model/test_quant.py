"""Weight-only int8 (`--quantize int8`): the paged forward of a quantized model equals the dense
reference of the same quantized weights, stays close to fp32, and bad settings are clear errors.
The agreement of SmolLM2's int8 greedy output with fp32 is measured (slow)."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers.model import BACKENDS, paged_logits
from minisched.model import weights
from minisched.model.config import preset
from minisched.model.llama import LlamaModel, dense_forward
from minisched.model.packed import PackedWeight
from minisched.model.quant import Int8Weight, QuantConfig, quantize_model
from minisched.ops import reference


def model_of(tie: bool) -> LlamaModel:
    cfg, state = weights.dummy_weights(preset("tiny", tie_embeddings=tie), seed=3)
    return LlamaModel.from_state_dict(cfg, state)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
def test_quantized_paged_forward_matches_dense(tie, backend):
    fp32 = model_of(tie)
    q = quantize_model(copy.deepcopy(fp32), QuantConfig("int8", group_size=32))
    assert isinstance(q.layers[0].qkv, Int8Weight) and isinstance(q.lm_head, Int8Weight)
    assert q.embed.dtype == torch.float32  # the lookup stays fp32
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (1, 17, 40)]
    cached = [0, 16, 9]
    got = paged_logits(q, seqs, cached, 16, backend)
    want = torch.cat([dense_forward(q, torch.tensor(s))[c:] for s, c in zip(seqs, cached)])
    # Each projection rounds its input rows to int16 (a step of 2^-15 of the row's largest value):
    # the float32-rounding differences of the two attention paths flip a few of those roundings.
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    exact = torch.cat([dense_forward(fp32, torch.tensor(s))[c:] for s, c in zip(seqs, cached)])
    err = (got - exact).abs().max().item()
    assert 0 < err < 0.05 * exact.abs().max().item()  # quantized, but close


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_paged_forward_matches_dense(tie, backend):
    """`--quantize bf16`: bfloat16 panels, float32 activations; the paged forward equals the dense one
    of the same model, and the rounding stays small against fp32."""
    fp32 = model_of(tie)
    q = quantize_model(copy.deepcopy(fp32), QuantConfig("bf16"))
    assert isinstance(q.layers[0].qkv, PackedWeight) and q.layers[0].qkv.dtype == torch.bfloat16
    assert isinstance(q.lm_head, PackedWeight) and q.embed.dtype == torch.float32
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (1, 17, 40)]
    cached = [0, 16, 9]
    got = paged_logits(q, seqs, cached, 16, backend)
    want = torch.cat([dense_forward(q, torch.tensor(s))[c:] for s, c in zip(seqs, cached)])
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    exact = torch.cat([dense_forward(fp32, torch.tensor(s))[c:] for s, c in zip(seqs, cached)])
    err = (got - exact).abs().max().item()
    assert 0 < err < 0.02 * exact.abs().max().item()
    assert quantize_model(q, QuantConfig("bf16")) is q  # already bf16: left as it is
    with pytest.raises(ValueError, match="int8 already"):
        quantize_model(quantize_model(model_of(tie), QuantConfig("int8")), QuantConfig("bf16"))


def test_quantized_weights_are_the_reference_dequantization():
    fp32 = model_of(True)
    q = quantize_model(copy.deepcopy(fp32), QuantConfig("int8", group_size=64))
    w = q.layers[1].gate_up
    w_q, scales = w.unpacked()
    back = reference.dequantize_int8(w_q, scales)
    assert scales.shape == (fp32.layers[1].gate_up.shape[0], 128 // 64)
    bound = scales.repeat_interleave(64, dim=1) / 2 + 1e-7
    assert ((back - fp32.layers[1].gate_up).abs() <= bound).all()
    total = sum(b.numel() * b.element_size() for b in q.buffers() if b.dtype == torch.int8)
    assert (
        total
        == sum(fp32.layers[i].__getattr__(n).numel() for i in range(2) for n in ("qkv", "o", "gate_up", "down"))
        + fp32.embed.numel()
    )


def test_quant_config_and_model_checks():
    with pytest.raises(ValueError, match="quantize must be one of"):
        QuantConfig("int4")
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantConfig("int8", group_size=48)
    assert quantize_model(model_of(True), QuantConfig("none")).layers[0].qkv.dtype == torch.float32
    cfg, state = weights.dummy_weights(preset("tiny"), seed=1)
    bf16 = LlamaModel.from_state_dict(cfg, state, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CPU with a float32 model"):
        quantize_model(bf16, QuantConfig("int8"))


@pytest.mark.slow
def test_smollm2_int8_agrees_with_fp32():
    """Teacher-forced next-token agreement along fp32's own greedy continuation, and the first
    generated tokens: int8 is not bit-exact, but it must pick fp32's token almost everywhere."""
    from minisched.engine import Engine

    try:
        path = weights.default_gguf_path()
    except weights.ModelNotFound as exc:
        pytest.skip(str(exc))
    from minisched.sched.sampling_params import SamplingParams

    fp32 = Engine(path, num_threads=2, quantize="none")  # float32 weights (the default is gguf: the same bits)
    q = Engine(path, num_threads=2, quantize="int8")
    prompts = ["What is the capital of France?", "Name three fruits.", "Why is the sky blue?"]
    outs = fp32.generate(prompts, SamplingParams(max_new_tokens=32), chat=True)
    agree = total = 0
    for p, o in zip(prompts, outs):
        ids = torch.tensor(fp32.encode(p, chat=True) + o.token_ids)
        a = dense_forward(fp32.model, ids).argmax(-1)
        b = dense_forward(q.model, ids).argmax(-1)
        start = len(ids) - len(o.token_ids) - 1
        agree += int((a[start:-1] == b[start:-1]).sum())
        total += len(o.token_ids)
    assert agree / total >= 0.9, f"int8 picked fp32's token at {agree}/{total} positions"
    q_out = q.generate(prompts[:1], SamplingParams(max_new_tokens=8), chat=True)[0]
    assert q_out.token_ids == outs[0].token_ids[:8]  # "The capital of France is Paris." is no near-tie
    b = Engine(path, num_threads=2, quantize="bf16")  # bfloat16 weights: 307 / 310 on bench_int8's 8 prompts
    agree = 0
    for p, o in zip(prompts, outs):
        ids = torch.tensor(fp32.encode(p, chat=True) + o.token_ids)
        start = len(ids) - len(o.token_ids) - 1
        agree += int(
            (dense_forward(fp32.model, ids).argmax(-1) == dense_forward(b.model, ids).argmax(-1))[start:-1].sum()
        )
    assert agree / total >= 0.95, f"bf16 picked fp32's token at {agree}/{total} positions"


def test_engine_quantize_option():
    from minisched.engine import Engine
    from minisched.model.tokenizer import MiniTokenizer
    from minisched.sched.sampling_params import SamplingParams

    model = model_of(True)
    tok = MiniTokenizer.byte_level(model.cfg.vocab_size)
    with pytest.raises(ValueError, match="quantize must be one of"):
        Engine(model, tokenizer=tok, quantize="int4")
    assert isinstance(model.layers[0].qkv, torch.Tensor)  # a rejected option changes nothing
    q = Engine(model, tokenizer=tok, quantize="int8", num_pages=32)
    assert isinstance(model.layers[0].qkv, Int8Weight)  # in place, as documented
    ids = [5, 6, 7, 8, 9]
    out = q.generate([ids], SamplingParams(max_new_tokens=6))[0].token_ids
    # greedy through the paged engine == greedy argmax of the dense reference of the same int8 model
    seq = list(ids)
    for _ in range(6):
        seq.append(int(dense_forward(model, torch.tensor(seq))[-1].argmax()))
    assert out == seq[len(ids) :]
    again = Engine(model, tokenizer=tok, quantize="int8", num_pages=32)  # already int8: left as it is
    assert again.generate([ids], SamplingParams(max_new_tokens=6))[0].token_ids == out
