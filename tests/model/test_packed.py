"""Packed float32 weights (model/packed.py, the CPU default): a packed model computes what the plain
one does (to float32 rounding) on the paged and dense paths; a tied model keeps one copy of its
embedding; the Engine packs by default only where the kernel runs; bad settings are clear errors."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers.model import BACKENDS, paged_logits
from minisched import ops
from minisched.model import weights
from minisched.model.config import preset
from minisched.model.llama import LlamaModel, dense_forward
from minisched.model.packed import PackedWeight, pack_model, want_packed
from minisched.model.quant import Int8Weight, QuantConfig, quantize_model
from minisched.model.tokenizer import MiniTokenizer

pytestmark = pytest.mark.skipif(not ops.native_available(), reason=str(ops.NATIVE_ERROR))


def model_of(tie: bool) -> LlamaModel:
    cfg, state = weights.dummy_weights(preset("tiny", tie_embeddings=tie), seed=5)
    return LlamaModel.from_state_dict(cfg, state)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_model_matches_plain(tie, backend):
    plain = model_of(tie)
    packed = pack_model(copy.deepcopy(plain))
    assert all(
        isinstance(getattr(layer, n), PackedWeight) for layer in packed.layers for n in ("qkv", "o", "gate_up", "down")
    )
    assert isinstance(packed.lm_head, PackedWeight)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (1, 17, 40)]
    cached = [0, 16, 9]
    got = paged_logits(packed, seqs, cached, 16, backend)
    want = torch.cat([dense_forward(plain, torch.tensor(s))[c:] for s, c in zip(seqs, cached)])
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    dense = torch.cat([dense_forward(packed, torch.tensor(s))[c:] for s, c in zip(seqs, cached)])
    torch.testing.assert_close(dense, want, atol=2e-4, rtol=2e-4)


def test_tied_model_keeps_one_copy():
    plain = model_of(True)
    packed = pack_model(copy.deepcopy(plain))
    assert packed.embed is packed.lm_head  # the lookup reads the packed head
    assert packed.dtype == torch.float32 and packed.device.type == "cpu"
    ids = torch.tensor([0, 15, 16, 17, plain.cfg.vocab_size - 1, 3, 3])
    assert torch.equal(packed.embed.rows(ids), plain.embed[ids])
    count = lambda m: sum(t.numel() for t in {id(t): t for t in list(m.parameters()) + list(m.buffers())}.values())
    pad = (16 - plain.cfg.vocab_size % 16) % 16 * plain.cfg.hidden_size  # the last panel's zero columns
    assert count(packed) - count(plain) <= pad + sum(
        (16 - getattr(layer, n).shape[0] % 16) % 16 * getattr(layer, n).shape[1]
        for layer in plain.layers
        for n in ("qkv", "o", "gate_up", "down")
    )


def test_untied_model_keeps_its_embedding():
    plain = model_of(False)
    packed = pack_model(copy.deepcopy(plain))
    assert isinstance(packed.embed, torch.nn.Parameter) and torch.equal(packed.embed, plain.embed)
    assert torch.equal(packed.lm_head.unpacked(), plain.lm_head)


def test_pack_is_idempotent_and_skips_int8():
    m = pack_model(model_of(True))
    w = m.layers[0].qkv.w_packed
    assert pack_model(m).layers[0].qkv.w_packed is w
    q = quantize_model(model_of(False), QuantConfig("int8", group_size=32))
    pack_model(q)
    assert isinstance(q.layers[0].qkv, Int8Weight) and isinstance(q.lm_head, Int8Weight)


@pytest.mark.parametrize("tie", [True, False])
def test_quantizing_a_packed_model(tie):
    """int8 from packed weights quantizes the same values as from the plain ones."""
    plain, packed = model_of(tie), pack_model(model_of(tie))
    a = quantize_model(plain, QuantConfig("int8", group_size=32))
    b = quantize_model(packed, QuantConfig("int8", group_size=32))
    assert torch.equal(a.layers[1].down.w_packed, b.layers[1].down.w_packed)
    assert torch.equal(a.lm_head.w_packed, b.lm_head.w_packed)
    assert isinstance(b.embed, torch.nn.Parameter) and torch.equal(b.embed, plain.embed)
    ids = torch.tensor([4, 9, 200])
    torch.testing.assert_close(dense_forward(b, ids), dense_forward(a, ids))


def test_want_packed():
    cpu = torch.device("cpu")
    assert want_packed(None, cpu, torch.float32, "native", False, False)
    assert not want_packed(None, cpu, torch.float32, "torch", False, False)
    assert not want_packed(None, cpu, torch.bfloat16, "native", False, False)
    assert not want_packed(None, cpu, torch.float32, "native", True, False)
    assert not want_packed(None, cpu, torch.float32, "native", False, True)
    assert not want_packed(None, torch.device("cuda"), torch.float32, "native", False, False)
    assert not want_packed(False, cpu, torch.float32, "native", False, False)
    for args, words in (
        ((cpu, torch.float32, "torch", False, False), "backend is 'torch'"),
        ((cpu, torch.float32, "native", True, False), "int8"),
        ((cpu, torch.float32, "native", False, True), "tensor-parallel"),
        ((cpu, torch.bfloat16, "native", False, False), "bfloat16"),
    ):
        with pytest.raises(ValueError, match=words):
            want_packed(True, *args)
    with pytest.raises(ValueError, match="True, False or None"):
        want_packed(1, cpu, torch.float32, "native", False, False)


def test_engine_packs_by_default_on_cpu():
    from minisched.engine import Engine
    from minisched.sched.sampling_params import SamplingParams

    tok = MiniTokenizer.byte_level(preset("tiny").vocab_size)
    packed = Engine(model_of(True), tokenizer=tok, num_pages=64, num_threads=1)
    plain = Engine(model_of(True), tokenizer=tok, num_pages=64, num_threads=1, pack_weights=False)
    assert packed.pack_weights and isinstance(packed.model.layers[0].qkv, PackedWeight)
    assert not plain.pack_weights and isinstance(plain.model.layers[0].qkv, torch.Tensor)
    assert not Engine(model_of(True), tokenizer=tok, num_pages=64, num_threads=1, backend="torch").pack_weights
    prompts = [[5, 6, 7], list(range(3, 40))]
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
    a, b = packed.generate(prompts, sp), plain.generate(prompts, sp)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    with pytest.raises(ValueError, match="pack_weights=True needs"):
        Engine(model_of(True), tokenizer=tok, num_pages=64, backend="torch", pack_weights=True)
    for mode in ("int8", "bf16"):  # the reason names the mode asked for (it said "int8" for bf16 too)
        with pytest.raises(ValueError, match=r"pack_weights=True needs .*quantized \(--quantize int8 / bf16\)"):
            Engine(model_of(True), tokenizer=tok, num_pages=64, quantize=mode, pack_weights=True)
