"""`--quantize gguf-a8`: the projections --quantize gguf keeps in the file's blocks, in gguf_a8_linear's
layout, which rounds the activations to 8 bits per block of 32 channels (llama.cpp's Q8 trade). The
logits are close to the float32 model's, not its bits; the mode is asked for, never what `auto` picks.

Each numeric test runs on the torch reference (ops.reference.gguf_a8_linear) and on the native kernel."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

from helpers.model import paged_logits
from helpers.tiny_gguf import fp32_model, write_tiny_gguf
from minisched import ops
from minisched.engine import Engine
from minisched.engine.config import EngineConfig
from minisched.engine.options import pick_quantize
from minisched.model import weights
from minisched.model.llama import LlamaModel
from minisched.model.packed import PackedWeight, pack_model
from minisched.model.quant import PROJECTIONS, GGUFWeight, QuantConfig, quantize_model
from minisched.model.tokenizer import MiniTokenizer
from minisched.sched.sampling_params import SamplingParams

needs_native = pytest.mark.skipif(not ops.native_available(), reason=str(ops.NATIVE_ERROR))
A8_BACKENDS = ["torch", pytest.param("native", marks=needs_native)]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    write_tiny_gguf(path)
    return path


def tiny_engine(model, **options) -> Engine:
    return Engine(model, tokenizer=MiniTokenizer.byte_level(512), num_pages=64, **options)


def projection_weights(model: LlamaModel) -> list:
    return [getattr(layer, n) for layer in model.decoder_layers for n in PROJECTIONS] + [model.lm_head]


def test_a8_keeps_the_projections_gguf_keeps(tiny_gguf):
    """The same weights as --quantize gguf (the same projections from the same blocks), each packed for
    gguf_a8_linear: the blocks come back unchanged and dequantize to the float32 model's weight."""
    blocks = weights.gguf_blocks(tiny_gguf)
    gguf = quantize_model(fp32_model(tiny_gguf), QuantConfig("gguf"), blocks)
    a8 = quantize_model(fp32_model(tiny_gguf), QuantConfig("gguf-a8"), blocks)
    fp32 = fp32_model(tiny_gguf)
    pairs = list(zip(projection_weights(gguf), projection_weights(a8), projection_weights(fp32)))
    assert sum(isinstance(g, GGUFWeight) for g, _, _ in pairs) == 3 * len(gguf.decoder_layers) + 1  # all but qkv
    for g, a, f in pairs:
        assert type(a) is type(g)
        if not isinstance(g, GGUFWeight):
            assert torch.equal(a, g)  # qkv: its parts differ in format, float32 in both
            continue
        assert isinstance(a, GGUFWeight) and (g.a8, a.a8) == (False, True) and (g.mode, a.mode) == ("gguf", "gguf-a8")
        assert a.qtype == g.qtype and a.shape == g.shape
        assert a.w_packed.dtype == torch.int32 and torch.equal(a.w_packed, ops.pack_gguf_a8_weight(g.blocks(), g.qtype))
        assert torch.equal(a.blocks(), g.blocks())
        assert torch.equal(a.unpacked(), f if f is not None else fp32.embed)  # the tied head: the embedding
    assert a8.decoder_layers[0].gate_up.qtype == int(T.Q4_1) and a8.lm_head.qtype == int(T.Q8_0)
    assert isinstance(a8.embed, torch.Tensor) and a8.embed.dtype == torch.float32  # the lookup stays float32


@pytest.mark.parametrize("backend", A8_BACKENDS)
def test_a8_logits_are_close_to_fp32(tiny_gguf, backend):
    """8-bit activations move each input by at most half a step, max |x| / 254 of its 32-channel block:
    about 0.5 % of the activations' size per projection (measured on this model: logits rows 0.5-0.7 %
    from fp32's, relative L2). Bounded here at 3 % per row, with the greedy token the same on at least 90 %
    of the rows; and at least 0.1 % on average, so that the activations were rounded (gguf's is fp32's)."""
    fp32 = fp32_model(tiny_gguf)
    a8 = quantize_model(fp32_model(tiny_gguf), QuantConfig("gguf-a8"), weights.gguf_blocks(tiny_gguf))
    if backend == "native":
        pack_model(fp32)  # the float tensors, packed as the engine does
        pack_model(a8)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (1, 17, 40)]
    cached = [0, 16, 9]
    got = paged_logits(a8, seqs, cached, 16, backend)
    want = paged_logits(fp32, seqs, cached, 16, backend)
    rel = (got - want).norm(dim=-1) / want.norm(dim=-1)
    assert rel.max() < 0.03, rel
    assert rel.mean() > 1e-3, rel  # not fp32's bits: gguf_a8_linear ran
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    if backend == "native":  # the kernel against the reference: close (float32 sums), not bit-equal
        ref = paged_logits(a8, seqs, cached, 16, "torch")
        assert ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).mean() < 1e-3  # 5x under a8's distance from fp32


def test_a8_mode_checks(tiny_gguf):
    """Without the blocks, a clear error; a model converted before is left as it is in its own mode and an
    error in the other one (converted in place, another engine may run it)."""
    model = fp32_model(tiny_gguf)
    with pytest.raises(ValueError, match="--quantize gguf-a8 needs the model's GGUF blocks"):
        quantize_model(copy.deepcopy(model), QuantConfig("gguf-a8"))
    blocks = weights.gguf_blocks(tiny_gguf)
    a8 = quantize_model(copy.deepcopy(model), QuantConfig("gguf-a8"), blocks)
    before = projection_weights(a8)
    assert all(a is b for a, b in zip(projection_weights(quantize_model(a8, QuantConfig("gguf-a8"), blocks)), before))
    with pytest.raises(ValueError, match="--quantize gguf: the model's weights are --quantize gguf-a8's blocks"):
        quantize_model(a8, QuantConfig("gguf"), blocks)
    gguf = quantize_model(copy.deepcopy(model), QuantConfig("gguf"), blocks)
    with pytest.raises(ValueError, match="--quantize gguf-a8: the model's weights are --quantize gguf's blocks"):
        quantize_model(gguf, QuantConfig("gguf-a8"), blocks)


@pytest.mark.parametrize("backend", A8_BACKENDS)
def test_engine_gguf_a8_option(tiny_gguf, backend):
    """Through the engine: the engine names the mode (quant and config, kept by fresh()), the blocks run
    in the a8 layout and the file's float tensors are packed where fp32's are (the native kernels)."""
    e = tiny_engine(tiny_gguf, quantize="gguf-a8", backend=backend)
    assert e.quant.mode == e.config.quantize == "gguf-a8"
    layer = e.model.decoder_layers[0]
    assert isinstance(layer.gate_up, GGUFWeight) and layer.gate_up.a8
    assert isinstance(e.model.lm_head, GGUFWeight) and e.model.lm_head.a8
    assert e.pack_weights == (backend == "native") and isinstance(layer.qkv, PackedWeight) == (backend == "native")
    prompts = [[5, 6, 7, 8, 9], list(range(10, 60))]
    params = SamplingParams(max_new_tokens=8)
    outs = [o.token_ids for o in e.generate(prompts, params)]
    assert [len(t) for t in outs] == [8, 8]
    again = e.fresh()  # the same loaded model, the resolved mode kept
    assert again.quant.mode == again.config.quantize == "gguf-a8" and again.model is e.model
    assert [o.token_ids for o in again.generate(prompts, params)] == outs
    with pytest.raises(ValueError, match="quantize='gguf': this model object's weights are --quantize gguf-a8's"):
        e.fresh(quantize="gguf")


@pytest.mark.parametrize("mode", ["gguf", "gguf-a8"])
def test_a_converted_model_object_keeps_its_mode(tiny_gguf, mode):
    """A model object an engine converted in place: a new engine on it (auto, or fresh()) names the mode its
    weights are in, not none; asking for another mode is one clear ValueError (none used to run the blocks
    while the engine said none; int8 failed inside quantize_model with a TypeError)."""
    e = tiny_engine(tiny_gguf, quantize=mode)
    again = tiny_engine(e.model)  # the default, auto
    assert again.quant.mode == again.config.quantize == mode
    for other in ("none", "int8", "bf16", "gguf" if mode == "gguf-a8" else "gguf-a8"):
        with pytest.raises(
            ValueError, match=f"quantize='{other}': this model object's weights are --quantize {mode}'s"
        ):
            e.fresh(quantize=other)
    assert isinstance(e.model.lm_head, GGUFWeight) and e.model.lm_head.mode == mode  # nothing was touched
    out = e.fresh().generate([[5, 6, 7]], SamplingParams(max_new_tokens=4))[0].token_ids
    assert len(out) == 4


def test_explicit_gguf_a8_needs_the_gguf_file(tiny_gguf):
    """As explicit gguf: a model object without its file named, or a model that is no GGUF file, is one clear
    ValueError at construction that names gguf-a8, and the model is left as it was."""
    cpu, f32 = torch.device("cpu"), torch.float32
    for name in (None, "custom", "dummy:tiny"):  # a model object whose file is not named
        with pytest.raises(ValueError, match="--quantize gguf-a8 needs a model loaded from a GGUF file"):
            pick_quantize("gguf-a8", cpu, f32, "native", False, name, False)
    model = fp32_model(tiny_gguf)
    with pytest.raises(ValueError, match=r"--quantize gguf-a8 needs a model loaded .* quantize='gguf-a8'"):
        tiny_engine(model, quantize="gguf-a8")
    assert isinstance(model.decoder_layers[0].gate_up, torch.Tensor)  # a rejected option changes nothing
    with pytest.raises(ValueError, match="needs a GGUF model"):
        Engine("dummy:tiny", num_pages=64, quantize="gguf-a8")
    named = Engine(  # a model object with its file named: the file's blocks
        model,
        config=EngineConfig(model=tiny_gguf, quantize="gguf-a8", backend="torch", num_pages=64),
        tokenizer=MiniTokenizer.byte_level(512),
    )
    assert named.quant.mode == "gguf-a8" and isinstance(named.model.lm_head, GGUFWeight) and named.model.lm_head.a8


def test_pick_quantize_gguf_a8(tiny_gguf):
    """Explicit gguf-a8 is itself with the file's blocks wherever it can run (any backend, --no-pack-weights:
    the blocks are their own format); auto is never gguf-a8, on every combination of the options it reads."""
    cpu, f32 = torch.device("cpu"), torch.float32
    for backend, pack, loaded in itertools.product(("native", "torch"), (None, False), (True, False)):
        mode, blocks = pick_quantize("gguf-a8", cpu, f32, backend, False, tiny_gguf, loaded, pack)
        assert mode == QuantConfig("gguf-a8") and blocks is not None
        assert blocks.keys() == weights.gguf_blocks(tiny_gguf).keys()
    seen = set()
    for device, dtype, backend, tp, loaded, pack in itertools.product(
        (cpu, torch.device("cuda")),
        (f32, torch.bfloat16),
        ("native", "torch", "triton"),
        (False, True),
        (True, False),
        (None, False),  # True where packing cannot be is want_packed's error, before any choice
    ):
        mode, _ = pick_quantize("auto", device, dtype, backend, tp, tiny_gguf, loaded, pack)
        seen.add(mode.mode)
    assert seen == ({"gguf", "none"} if ops.native_available() else {"none"})  # never gguf-a8
