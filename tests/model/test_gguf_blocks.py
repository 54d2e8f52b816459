"""`--quantize gguf`: a GGUF model's block-quantized tensors (Q4_0, Q4_1, Q8_0) stay in their blocks and
run through gguf_linear; tensors in other formats, and a fused projection whose parts differ in
format, stay float32. The logits are the float32 model's bits (the float32 model is the file
dequantized), so greedy output is identical. `--quantize auto`, the default, resolves to gguf exactly
where that holds (a float32 GGUF model with block-quantized projections on the CPU, native kernels, no
--tp) and to none elsewhere; on SmolLM2 (slow) the default loses nothing against --quantize none."""

from __future__ import annotations

import copy

import pytest
import torch
from gguf.constants import GGMLQuantizationType as T

from helpers.model import BACKENDS, paged_logits
from helpers.tiny_gguf import FORMATS, fp32_model, write_tiny_gguf
from minisched import ops
from minisched.engine import Engine
from minisched.engine.config import EngineConfig
from minisched.engine.options import pick_quantize
from minisched.model import weights
from minisched.model.llama import LlamaModel
from minisched.model.packed import PackedWeight, pack_model
from minisched.model.quant import PROJECTIONS, GGUFWeight, QuantConfig, keep_gguf_blocks, quantize_model
from minisched.model.tokenizer import MiniTokenizer
from minisched.sched.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    write_tiny_gguf(path)
    return path


def test_blocks_are_the_loaded_float32_weights(tiny_gguf):
    """weights.gguf_blocks holds every block tensor, rows unpermuted as the float loader does: each
    dequantizes to the float32 weight load_gguf gives (bit for bit)."""
    blocks = weights.gguf_blocks(tiny_gguf)
    _, state = weights.load(tiny_gguf)
    assert "model.layers.0.self_attn.v_proj.weight" not in blocks  # float32 in the file
    assert blocks["model.embed_tokens.weight"][0] == int(T.Q8_0)
    assert len(blocks) == 1 + 2 * 6
    for name, (qtype, b) in blocks.items():
        assert torch.equal(ops.reference.dequantize_gguf(b, qtype), state[name]), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_gguf_weights_give_the_float32_bits(tiny_gguf, backend):
    fp32 = pack_model(fp32_model(tiny_gguf))
    q = quantize_model(fp32_model(tiny_gguf), QuantConfig("gguf"), weights.gguf_blocks(tiny_gguf))
    layer = q.decoder_layers[0]
    assert isinstance(layer.gate_up, GGUFWeight) and layer.gate_up.qtype == int(T.Q4_1)
    assert isinstance(layer.o, GGUFWeight) and layer.o.qtype == int(T.Q4_0)
    assert isinstance(layer.down, GGUFWeight) and layer.down.qtype == int(T.Q8_0)
    assert isinstance(layer.qkv, torch.Tensor)  # Q4_1 q, k with a float32 v: stays float
    assert isinstance(q.lm_head, GGUFWeight) and q.lm_head.qtype == int(T.Q8_0)
    assert isinstance(q.embed, torch.Tensor) and q.embed.dtype == torch.float32  # the lookup
    pack_model(q)  # the float tensors: packed, as the engine does
    assert isinstance(q.decoder_layers[0].qkv, PackedWeight) and isinstance(q.lm_head, GGUFWeight)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (1, 17, 40)]
    cached = [0, 16, 9]
    got = paged_logits(q, seqs, cached, 16, backend)
    want = paged_logits(fp32, seqs, cached, 16, backend)
    if backend == "native":
        assert torch.equal(got, want)  # the same weights, the same FMA chains
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    w = q.decoder_layers[1].gate_up
    assert torch.equal(w.unpacked(), fp32.decoder_layers[1].gate_up.unpacked())


def test_gguf_mode_checks(tiny_gguf):
    model = fp32_model(tiny_gguf)
    with pytest.raises(ValueError, match="needs the model's GGUF blocks"):
        quantize_model(copy.deepcopy(model), QuantConfig("gguf"))
    with pytest.raises(ValueError, match="needs a GGUF model"):
        weights.gguf_blocks("dummy:tiny")
    other = weights.gguf_blocks(tiny_gguf)
    name = "model.layers.0.mlp.down_proj.weight"
    other[name] = (other[name][0], other[name][1][:, :-34])  # one block short per row
    with pytest.raises(ValueError, match="does not hold the model's"):
        keep_gguf_blocks(copy.deepcopy(model), other)


def tiny_engine(model, **options) -> Engine:
    return Engine(model, tokenizer=MiniTokenizer.byte_level(512), num_pages=64, **options)


def test_engine_gguf_option(tiny_gguf):
    """Through the engine: --quantize gguf packs the float tensors and keeps the blocks; greedy output
    equals the float32 engine's (--quantize none)."""
    fp32 = tiny_engine(tiny_gguf, quantize="none")
    q = tiny_engine(tiny_gguf, quantize="gguf")
    assert q.quant.mode == q.config.quantize == "gguf"
    assert isinstance(q.model.lm_head, GGUFWeight) and isinstance(q.model.decoder_layers[0].qkv, PackedWeight)
    assert not isinstance(fp32.model.decoder_layers[0].gate_up, GGUFWeight)
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300], list(range(10, 60))]
    params = SamplingParams(max_new_tokens=12)
    assert [o.token_ids for o in q.generate(prompts, params)] == [o.token_ids for o in fp32.generate(prompts, params)]


# -- --quantize auto, the default: resolved once, by engine/options.py pick_quantize --------------------


def projection_weights(model: LlamaModel) -> list:
    return [getattr(layer, n) for layer in model.decoder_layers for n in PROJECTIONS] + [model.lm_head]


@pytest.mark.skipif(not ops.native_available(), reason="auto picks gguf with the native kernels only")
def test_auto_is_gguf_for_a_block_quantized_gguf_file(tiny_gguf):
    """The default on a GGUF file whose projections are blocks, float32 on the CPU with the native kernels:
    gguf, which the engine names (its quant and its config, which engine.fresh keeps); greedy output is
    --quantize none's."""
    assert EngineConfig().quantize == "auto"
    auto = tiny_engine(tiny_gguf)
    assert auto.quant.mode == auto.config.quantize == "gguf"
    layer = auto.model.decoder_layers[0]
    assert isinstance(layer.gate_up, GGUFWeight) and isinstance(auto.model.lm_head, GGUFWeight)
    assert isinstance(layer.qkv, PackedWeight)  # its parts differ in format: float32, packed, as with explicit gguf
    fp32 = tiny_engine(tiny_gguf, quantize="none")
    assert fp32.quant.mode == fp32.config.quantize == "none"
    assert not any(isinstance(w, GGUFWeight) for w in projection_weights(fp32.model))
    prompts = [[5, 6, 7, 8, 9], list(range(10, 60))]
    params = SamplingParams(max_new_tokens=12)
    want = [o.token_ids for o in fp32.generate(prompts, params)]
    assert [o.token_ids for o in auto.generate(prompts, params)] == want
    again = auto.fresh()  # the same loaded model, the resolved mode kept
    assert again.quant.mode == "gguf" and again.model is auto.model
    assert [o.token_ids for o in again.generate(prompts, params)] == want


@pytest.mark.parametrize(
    "case", ["model object", "dummy", "backend torch", "dtype bfloat16", "float gguf", "float gguf, Q8_0 head"]
)
def test_auto_is_none_elsewhere(tiny_gguf, tmp_path, case):
    """The default where gguf is not the float32 path's bits from the file's blocks: float32 (packed where
    that is the default), no GGUFWeight anywhere."""
    if case == "model object":  # a model object has no file (explicit gguf reads config.model's)
        e = tiny_engine(fp32_model(tiny_gguf))
    elif case == "dummy":
        e = Engine("dummy:tiny", num_pages=64)
    elif case == "backend torch":
        e = tiny_engine(tiny_gguf, backend="torch")
    elif case == "dtype bfloat16":
        e = tiny_engine(tiny_gguf, dtype="bfloat16")
    else:  # float projections; a Q8_0 embedding alone (the tied head) is no reason either
        path = str(tmp_path / "float.gguf")
        write_tiny_gguf(path, formats=dict.fromkeys(FORMATS, T.F32), embed=T.Q8_0 if "head" in case else T.F32)
        e = tiny_engine(path)
    assert e.quant.mode == e.config.quantize == "none"
    assert not any(isinstance(w, GGUFWeight) for w in projection_weights(e.model))
    packed = ops.native_available() and case not in ("backend torch", "dtype bfloat16")
    assert e.pack_weights == packed and isinstance(e.model.decoder_layers[0].qkv, PackedWeight) == packed


@pytest.mark.skipif(not ops.native_available(), reason="auto picks gguf with the native kernels only")
def test_no_pack_weights_is_the_plain_float32_path(tiny_gguf):
    """--no-pack-weights asks for the plain float32 path: auto resolves to none there (no blocks, nothing
    packed). Explicit gguf still runs the blocks (their own format); the file's float tensors stay unpacked,
    and the logits are the float32 model's up to the unpacked matmuls' rounding."""
    auto = tiny_engine(tiny_gguf, pack_weights=False)
    assert auto.quant.mode == auto.config.quantize == "none" and auto.pack_weights is False
    assert not any(isinstance(w, (GGUFWeight, PackedWeight)) for w in projection_weights(auto.model))
    q = tiny_engine(tiny_gguf, quantize="gguf", pack_weights=False)
    assert q.quant.mode == q.config.quantize == "gguf" and q.pack_weights is False
    layer = q.model.decoder_layers[0]
    assert isinstance(layer.gate_up, GGUFWeight) and isinstance(q.model.lm_head, GGUFWeight)
    assert isinstance(layer.qkv, torch.Tensor)  # float in the file (its parts differ), not packed
    seqs, cached = [[5, 6, 7, 8, 9], list(range(10, 60))], [0, 16]
    got = paged_logits(q.model, seqs, cached, 16, "native")
    want = paged_logits(auto.model, seqs, cached, 16, "native")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_explicit_gguf_on_a_model_object_needs_its_file(tiny_gguf):
    """--quantize gguf on a model object reads the blocks of the file config.model names; with none named
    it is one clear ValueError at construction (the bundled SmolLM2's blocks are not assumed), Engine.fresh
    included (its name for a model object, "custom", is no file), and the model is left as it was."""
    model = fp32_model(tiny_gguf)
    with pytest.raises(ValueError, match="needs a model loaded from a GGUF file"):
        tiny_engine(model, quantize="gguf")
    assert isinstance(model.decoder_layers[0].gate_up, torch.Tensor)  # a rejected option changes nothing
    plain = tiny_engine(model, quantize="none")
    assert plain.model_name == "custom"
    with pytest.raises(ValueError, match="needs a model loaded from a GGUF file"):
        plain.fresh(quantize="gguf")
    named = Engine(
        fp32_model(tiny_gguf),
        config=EngineConfig(model=tiny_gguf, quantize="gguf", num_pages=64),
        tokenizer=MiniTokenizer.byte_level(512),
    )
    assert named.quant.mode == "gguf" and isinstance(named.model.lm_head, GGUFWeight)
    again = named.fresh()
    assert again.quant.mode == again.config.quantize == "gguf" and again.model is named.model


def test_pick_quantize(tiny_gguf, tmp_path):
    """pick_quantize's cases without an engine: CUDA, safetensors, --tp, the Triton backend, a model passed
    in; explicit modes are themselves (their errors are quantize_model's and gguf_blocks')."""
    cpu, f32 = torch.device("cpu"), torch.float32

    def pick(
        quantize="auto", device=cpu, dtype=f32, backend="native", tp=False, model=tiny_gguf, loaded=True, pack=None
    ):
        return pick_quantize(quantize, device, dtype, backend, tp, model, loaded, pack)

    none = (QuantConfig("none"), None)
    if ops.native_available():
        mode, blocks = pick()
        assert mode == QuantConfig("gguf") and blocks is not None
        assert blocks.keys() == weights.gguf_blocks(tiny_gguf).keys()
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    for kw in (
        dict(device=torch.device("cuda")),
        dict(dtype=torch.bfloat16),
        dict(backend="torch"),
        dict(backend="triton"),
        dict(tp=True),
        dict(loaded=False),
        dict(model="dummy:tiny"),
        dict(model=str(hf)),
        dict(pack=False),  # --no-pack-weights: the plain float32 path
    ):
        assert pick(**kw) == none, kw
    assert pick("none") == none
    assert pick("int8", backend="torch") == (QuantConfig("int8"), None)
    mode, blocks = pick("gguf", backend="torch", loaded=False)  # explicit gguf: the file's blocks, wherever it can run
    assert mode == QuantConfig("gguf") and blocks is not None
    mode, blocks = pick("gguf", pack=False)  # --no-pack-weights leaves explicit gguf as it is
    assert mode == QuantConfig("gguf") and blocks is not None
    for name in (None, "custom", "dummy:tiny"):  # a model object whose file is not named
        with pytest.raises(ValueError, match="needs a model loaded from a GGUF file"):
            pick("gguf", loaded=False, model=name)
    with pytest.raises(ValueError, match="needs a GGUF model"):
        pick("gguf", model="dummy:tiny")
    with pytest.raises(ValueError, match="needs a GGUF model"):
        Engine("dummy:tiny", num_pages=64, quantize="gguf")


def test_auto_with_tp_is_no_error():
    """auto resolves to none under --tp (the ranks shard float32 weights); only an explicit mode is an error."""
    assert EngineConfig(tp=2).quantize == "auto"
    assert EngineConfig(tp=2, quantize="none").tp == 2
    for mode in ("int8", "bf16", "gguf", "gguf-a8"):
        with pytest.raises(ValueError, match="quantize with tensor parallelism"):
            EngineConfig(tp=2, quantize=mode)


@pytest.mark.slow
def test_smollm2_gguf_greedy_equals_fp32():
    """The default engine on the bundled SmolLM2 runs gguf (--quantize auto): its Q4_1 projections and Q8_0
    head from their blocks. Against --quantize none it loses nothing: the greedy continuations of the held
    chat prompts are the same tokens, and every forward's logits -- the prefill, then each decode step --
    are the same bits (the same weights, packed_linear's FMA chains)."""
    try:
        weights.default_gguf_path()
    except weights.ModelNotFound as exc:
        pytest.skip(str(exc))
    default = Engine(num_threads=2, num_pages=64)
    fp32 = Engine(num_threads=2, num_pages=64, quantize="none")
    assert default.quant.mode == default.config.quantize == "gguf" and fp32.quant.mode == "none"
    assert all(isinstance(w, GGUFWeight) for w in projection_weights(default.model))
    assert all(isinstance(w, PackedWeight) for w in projection_weights(fp32.model))
    prompts = ["What is the capital of France?", "Name three fruits.", "Why is the sky blue?"]
    params = SamplingParams(max_new_tokens=32)
    logits: dict[str, list[torch.Tensor]] = {"default": [], "none": []}
    outs = {}
    for name, engine in (("default", default), ("none", fp32)):
        hook = engine.model.register_forward_hook(lambda m, args, out, name=name: logits[name].append(out.clone()))
        try:
            outs[name] = [o.token_ids for o in engine.generate(prompts, params, chat=True)]
        finally:
            hook.remove()
    assert outs["default"] == outs["none"]
    assert len(logits["default"]) == len(logits["none"]) >= 4  # one prefill + decode steps
    assert logits["default"][0].shape[0] == len(prompts)  # the prefill's last rows
    for step, (a, b) in enumerate(zip(logits["default"], logits["none"])):
        assert torch.equal(a, b), f"forward {step}: logits differ by {(a - b).abs().max().item()}"
