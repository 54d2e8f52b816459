"""The families people run -- Qwen2/2.5, Qwen3, Mistral, Llama-3.x -- each equal to transformers, from an HF
folder and from a GGUF file, with nothing downloaded: tests/helpers/families.py builds each one tiny from its
real transformers config and model classes, biases and norms randomised, rope_theta 1e6 (and Llama-3's
scaling), and writes it as llama.cpp would.

Greedy tokens equal transformers' on several chat prompts and logits are within SmolLM2's tolerances
(tests/model/test_model.py) through the native CPU kernels, the torch reference and the Triton interpreter;
the tokenizer, the chat template and the stop tokens are transformers'; `--quantize gguf` computes the
float32 path's bits on the file's blocks and the other modes keep the biases and q/k norms; an unsupported
architecture or option and a tensor the model would not read are one-line errors. (TP=2:
tests/parallel/test_families_tp.py.)

Before the families' pieces existed, a Qwen2 folder loaded without a word and ignored its q/k/v biases, and a
Qwen3 folder its q/k norms: test_greedy_equals_transformers[qwen2-hf-*] and [qwen3-hf-*] failed from the first token.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from helpers import families as F
from helpers.model import paged_logits
from minisched import ops
from minisched.engine import Engine
from minisched.model import weights
from minisched.model.config import Llama3RopeScaling, RopeFreqFactors, preset
from minisched.model.families import config_from_hf
from minisched.model.llama import LlamaModel, dense_forward
from minisched.model.tokenizer import MiniTokenizer
from minisched.sched.sampling_params import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "def f(x):\n    return x * 2",
    "Name three prime numbers and explain why they are prime.",
]
BACKENDS = ["torch", "triton"] + (["native"] if ops.native_available() else [])
N_NEW = 10


@pytest.fixture(scope="module", params=list(F.FAMILIES))
def tiny(request, tmp_path_factory) -> F.TinyFamily:
    return F.build(request.param, tmp_path_factory.mktemp(request.param))


def chats(tiny: F.TinyFamily) -> list[list[int]]:
    """The chat prompts as transformers tokenizes them (18-40 tokens)."""
    msgs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    return [
        list(tiny.hf_tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True)["input_ids"])
        for m in msgs
    ]


def spec(tiny: F.TinyFamily, source: str) -> str:
    return tiny.hf_dir if source == "hf" else tiny.gguf_path


@pytest.fixture(scope="module")
def refs(tiny) -> list[list[int]]:
    return [F.hf_greedy(tiny.model, p, N_NEW) for p in chats(tiny)]


@pytest.mark.parametrize(
    "source, backend",
    [("hf", b) for b in BACKENDS] + [("gguf", b) for b in BACKENDS if b != "triton"],  # the kernels see one model
)
def test_greedy_equals_transformers(tiny, refs, source, backend):
    """Chunked prefill (chunks of 16 over pages of 4) and decode, every prompt in one batch."""
    e = Engine(spec(tiny, source), backend=backend, page_size=4, chunk_size=16)
    outs = e.generate(chats(tiny), SamplingParams(max_new_tokens=N_NEW, ignore_eos=True))
    assert len({t for o in outs for t in o.token_ids}) > N_NEW  # the tokens depend on the prompt, not one repeated
    for o, want in zip(outs, refs):
        assert o.error is None, o.error
        assert o.token_ids == want, f"prompt {o.index}"


def fp32_model(path: str) -> LlamaModel:
    cfg, state = weights.load(path)
    return LlamaModel.from_state_dict(cfg, state)


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_logits_match_transformers(tiny, source):
    model = fp32_model(spec(tiny, source))
    ids = chats(tiny)[0]
    want = F.hf_logits(tiny.model, ids)
    torch.testing.assert_close(dense_forward(model, torch.tensor(ids)), want, atol=3e-4, rtol=1e-4)
    for backend in BACKENDS:  # a cached prefix of 9 tokens, the rest as new tokens
        got = paged_logits(model, [ids], [9], 4, backend)
        torch.testing.assert_close(got, want[9:], atol=2e-3, rtol=1e-3, msg=lambda m: f"{backend}: {m}")


def test_config_of_each_family(tiny):
    """What the folder and the file say, read the same way: the family, its pieces, the context."""
    name = tiny.family.name
    hf, gguf = weights.load_config(tiny.hf_dir), weights.load_config(tiny.gguf_path)
    assert hf.architecture == tiny.model.config.model_type  # llama3's is llama
    assert gguf.architecture == tiny.family.gguf_arch  # llama.cpp writes Mistral as llama
    for cfg in (hf, gguf):
        assert cfg.qkv_bias == (name == "qwen2") and cfg.qk_norm == (name == "qwen3")
        assert cfg.rope_theta == 1e6 and cfg.tie_embeddings == tiny.model.config.tie_word_embeddings
        assert (cfg.num_heads, cfg.num_kv_heads) == (4, tiny.model.config.num_key_value_heads)
        assert cfg.q_size == 4 * (32 if name == "qwen3" else 16)
    assert isinstance(hf.rope_scaling, Llama3RopeScaling) == isinstance(gguf.rope_scaling, RopeFreqFactors)
    assert (hf.rope_scaling is not None) == (name == "llama3")
    # Mistral slides a 4096-token window over its 32768: full attention here equals it up to the window
    assert hf.max_position == (4096 if name == "mistral" else tiny.model.config.max_position_embeddings)


def test_tokenizer_chat_template_and_stops(tiny):
    """From the folder and from the file: transformers' ids (BOS where its tokenizer adds one), its decoding,
    its rendering of the chat template, and the model's stop tokens."""
    hf = tiny.hf_tokenizer
    texts = ["Hello world", "What is 12345 + 678?", "  spaces\n\n\ttabs  ", "héllo wörld 日本語 🙂", "I'm sure", ""]
    msgs = [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    ids = {t: tiny.hf_tokenizer.convert_tokens_to_ids(t) for t in tiny.family.specials}
    for tok in (MiniTokenizer.from_hf_dir(tiny.hf_dir), MiniTokenizer.from_gguf(tiny.gguf_path)):
        for t in texts:
            assert tok.encode(t) == hf.encode(t), t
            assert tok.decode(tok.encode(t)) == hf.decode(hf.encode(t), skip_special_tokens=True)
        assert tok.apply_chat_template(msgs) == hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        want = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"]
        assert tok.encode_chat(msgs) == list(want)  # the template's own BOS, not a second one
        assert tok.eos_token_id == ids[tiny.family.eos] and set(tok.stop_token_ids) >= {ids[tiny.family.eos]}
        # the bytes of each token (structured outputs' vocabulary): SentencePiece's "\u2581" is a space, and
        # its text starts with one (the Metaspace prefix that decoding strips)
        text = "héllo wörld 🙂 ok"
        pieces = b"".join(tok.token_bytes(i) for i in tok.encode(text, add_special_tokens=False))
        assert pieces == (b" " if tiny.family.split == F.SPM else b"") + text.encode()
    folder = MiniTokenizer.from_hf_dir(tiny.hf_dir)
    assert set(folder.stop_token_ids) == {ids[t] for t in (tiny.family.eos, *tiny.family.stops)}


FEATURE_TEMPLATE = (  # what real templates use: Qwen's tools | tojson and enable_thinking, Llama-3.2's strftime_now
    "{%- set ns = namespace(n=0) %}{%- if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
    "{%- for m in messages %}{%- set ns.n = ns.n + 1 %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant {{ ns.n }} {{ strftime_now('%Y') }}\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def test_chat_template_features_render_as_transformers(tmp_path):
    fam = F.build("qwen3", tmp_path)
    (tmp_path / "hf" / "chat_template.jinja").write_text(FEATURE_TEMPLATE)
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ours = MiniTokenizer.from_hf_dir(fam.hf_dir)
    msgs = [{"role": "user", "content": "Weather <in> 'Paris' & Köln?"}]
    tools = [{"type": "function", "function": {"name": "weather", "description": "<now> & 'later' in Köln"}}]
    for kw in ({}, {"enable_thinking": False}, {"tools": tools}):
        want = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, **kw)
        assert ours.apply_chat_template(msgs, True, **kw) == want, kw


def test_engine_stops_at_every_stop_token(tiny, tmp_path):
    """The engine stops at each of the model's end-of-turn tokens, not only at the EOS: a copy of the folder
    whose generation_config.json lists, beside the EOS, a token the greedy run reaches -- the run ends there
    without the request naming it (and runs on with ignore_eos)."""
    prompt = chats(tiny)[1]
    sp = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    free = Engine(tiny.hf_dir, page_size=4).generate([prompt], sp)[0].token_ids
    k = next(i for i in range(1, N_NEW) if free[i] not in free[:i])
    d = tmp_path / "hf"
    shutil.copytree(tiny.hf_dir, d)
    gen = json.loads((d / "generation_config.json").read_text())
    gen["eos_token_id"] = [tiny.hf_tokenizer.convert_tokens_to_ids(tiny.family.eos), free[k]]
    (d / "generation_config.json").write_text(json.dumps(gen))
    e = Engine(str(d), page_size=4)
    assert free[k] in e.tokenizer.stop_token_ids
    out = e.generate([prompt], SamplingParams(max_new_tokens=N_NEW))[0]
    assert out.token_ids == free[: k + 1] and out.finish_reason == "stop_token"
    assert e.generate([prompt], sp)[0].token_ids == free


# -- --quantize ---------------------------------------------------------------------------------------------

QWEN = ["qwen2", "qwen3"]


@pytest.fixture(scope="module", params=QWEN)
def blocks_file(request, tmp_path_factory):
    """A Qwen model's GGUF with Q8_0 / Q4_0 / Q4_1 projections (its biases and norms float32, as llama.cpp's)."""
    from gguf.constants import GGMLQuantizationType as T

    fam = F.build(request.param, tmp_path_factory.mktemp(request.param + "-q"))
    path = tmp_path_factory.mktemp("blocks") / "q.gguf"
    formats = {"attn_q": T.Q8_0, "attn_k": T.Q8_0, "attn_v": T.Q8_0, "attn_output": T.Q4_0}
    formats |= {"ffn_gate": T.Q4_1, "ffn_up": T.Q4_1, "ffn_down": T.Q8_0, "token_embd": T.Q8_0, "output": T.Q8_0}
    tok = F.train_tokenizer(fam.family)
    F.write_gguf(fam.model, tok, fam.family, path, formats)
    return fam, str(path)


@pytest.mark.skipif(not ops.native_available(), reason="the quantized kernels are native")
def test_gguf_blocks_compute_the_fp32_bits(blocks_file):
    """--quantize gguf on a Qwen file: the float32 model's greedy tokens (its weights are the file dequantized),
    the q/k/v biases and q/k norms applied beside the block-quantized projections."""
    fam, path = blocks_file
    prompts = chats(fam)
    sp = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    q = Engine(path, quantize="gguf", page_size=4)
    assert q.quant.mode == "gguf" and type(q.model.decoder_layers[0].qkv).__name__ == "GGUFWeight"
    ref = Engine(path, quantize="none", page_size=4)
    assert [o.token_ids for o in q.generate(prompts, sp)] == [o.token_ids for o in ref.generate(prompts, sp)]


@pytest.mark.skipif(not ops.native_available(), reason="the quantized kernels are native")
@pytest.mark.parametrize("mode", ["gguf-a8", "int8", "bf16"])
def test_quantized_modes_keep_the_biases_and_norms(blocks_file, mode):
    """The approximate modes stay near the float32 model's logits -- much nearer than the model without the
    family's piece (biases zeroed, q/k norms set to 1), so the piece is applied in that mode too."""
    fam, path = blocks_file
    ids = chats(fam)[0]
    want = paged_logits(fp32_model(path), [ids], [0], 4, "native")
    q = Engine(path, quantize=mode, page_size=4).model
    err = (paged_logits(q, [ids], [0], 4, "native") - want).abs().max()
    broken = fp32_model(path)
    for layer in broken.decoder_layers:
        if layer.qkv_bias is not None:
            layer.qkv_bias.zero_()
        if layer.q_norm is not None and layer.k_norm is not None:
            layer.q_norm.fill_(1.0)
            layer.k_norm.fill_(1.0)
    err_without = (paged_logits(broken, [ids], [0], 4, "native") - want).abs().max()
    print(f"{mode}: {float(err):.4f} vs {float(err_without):.4f} without the piece")
    assert err < err_without / 5, (float(err), float(err_without))


# -- what is refused, in one line -------------------------------------------------------------------------------


def one_line_load_error(spec_: str, *needles: str) -> str:
    with pytest.raises(weights.ModelLoadError) as e:
        Engine(spec_, page_size=4)
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in needles), msg
    return msg


def test_unread_tensors_are_an_error(tiny, tmp_path):
    """A checkpoint the model would leave tensors of unread: the Qwen2 folder declared a Llama (today's silent
    load of a Qwen2 checkpoint, the other way round), a Llama-family folder with an o_proj bias, a GGUF file
    with a tensor of no known name."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "hf"
    shutil.copytree(tiny.hf_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    state = load_file(d / "model.safetensors")
    if tiny.family.name == "qwen2":
        cfg.update(architectures=["LlamaForCausalLM"], model_type="llama")
        (d / "config.json").write_text(json.dumps(cfg))
        one_line_load_error(str(d), "left unread", "model.layers.0.self_attn.k_proj.bias", "llama")
        return
    state["model.layers.1.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(state, d / "model.safetensors")
    one_line_load_error(str(d), "1 tensors", "model.layers.1.self_attn.o_proj.bias")
    # the GGUF file with one more tensor, under a name no family here has (a MoE router)
    path = tmp_path / "extra.gguf"
    router = {"blk.0.ffn_gate_inp.weight": torch.zeros(4, 64).numpy()}
    F.write_gguf(tiny.model, F.train_tokenizer(tiny.family), tiny.family, path, extra=router)
    one_line_load_error(str(path), "blk.0.ffn_gate_inp.weight", "would not read")


def test_a_tied_checkpoint_may_carry_its_head(tmp_path):
    """A tied checkpoint that saved lm_head.weight too loads when it is the embedding, and is an error when it
    is not (tie_word_embeddings would leave it unread)."""
    from safetensors.torch import load_file, save_file

    fam = F.build("qwen2", tmp_path)
    path = tmp_path / "hf" / "model.safetensors"
    state = load_file(path)
    save_file({**state, "lm_head.weight": state["model.embed_tokens.weight"].clone()}, path)
    Engine(fam.hf_dir, page_size=4)
    save_file({**state, "lm_head.weight": torch.zeros_like(state["model.embed_tokens.weight"])}, path)
    one_line_load_error(fam.hf_dir, "lm_head.weight", "tied=True")


def test_unpermute_restores_llama_cpp_rows_and_biases():
    """llama.cpp permutes a llama-architecture Q/K bias with its rows (convert_hf_to_gguf.py LlamaModel)."""
    w, b = torch.randn(4 * 16, 8), torch.randn(4 * 16)
    assert torch.equal(weights.unpermute_qk(F.llama_cpp_permute(w, 4), 4), w)
    assert torch.equal(weights.unpermute_qk(F.llama_cpp_permute(b, 4), 4), b)


@pytest.mark.parametrize(
    "change, needles",
    [
        (dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe"), ["unsupported architecture", "Qwen3Moe"]),
        (dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2"), ["'Gemma2ForCausalLM'", "Qwen2ForCausalLM"]),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), ["RoPE scaling 'yarn'"]),
        (dict(attention_bias=True), ["attention_bias"]),
        (dict(hidden_act="gelu"), ["hidden_act 'gelu'"]),
    ],
    ids=["moe", "gemma2", "yarn", "o-bias", "gelu"],
)
def test_unsupported_is_one_line(tmp_path, change, needles):
    root = tmp_path / "m"
    root.mkdir()
    fam = F.build("qwen3", root)
    cfg = json.loads((root / "hf" / "config.json").read_text())
    cfg.update(change)
    (root / "hf" / "config.json").write_text(json.dumps(cfg))
    one_line_load_error(fam.hf_dir, *needles)


def test_unsupported_gguf_architecture_exits_2(tmp_path, capsys):
    from gguf import GGUFWriter

    from minisched.cli import main

    path = tmp_path / "g.gguf"
    w = GGUFWriter(str(path), "gemma2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    rc = main(["generate", "hi", "--model", str(path)])
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert rc == 2 and len(err) == 1 and "unsupported GGUF architecture 'gemma2'" in err[0], err


# -- the real checkpoints' configs and RoPE --------------------------------------------------------------------

REAL_CONFIGS = {  # config.json of each checkpoint, as published (the keys that matter here)
    "qwen2.5-7b": {  # Qwen/Qwen2.5-7B-Instruct
        "architectures": ["Qwen2ForCausalLM"],
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "hidden_act": "silu",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "max_position_embeddings": 32768,
        "max_window_layers": 28,
        "model_type": "qwen2",
        "num_attention_heads": 28,
        "num_hidden_layers": 28,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 131072,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "vocab_size": 152064,
    },
    "qwen3-8b": {  # Qwen/Qwen3-8B
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "max_position_embeddings": 40960,
        "max_window_layers": 36,
        "model_type": "qwen3",
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    "llama3.1-8b": {  # meta-llama/Llama-3.1-8B-Instruct
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "vocab_size": 128256,
    },
    "mistral-7b": {  # mistralai/Mistral-7B-Instruct-v0.3
        "architectures": ["MistralForCausalLM"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "model_type": "mistral",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "vocab_size": 32768,
    },
}


@pytest.mark.parametrize("name", list(REAL_CONFIGS))
def test_dummy_presets_are_the_real_configs(name):
    """`dummy:<preset>` has the checkpoint's shapes and pieces (the old-style config.json keys: rope_theta and
    rope_scaling beside each other, eos lists)."""
    assert config_from_hf(REAL_CONFIGS[name]) == preset(name)


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "qwen3-0.6b", "llama3.2-1b", "mistral-7b"])
def test_dummy_weights_fit_their_model(name):
    """dummy weights carry every piece their family reads (one layer and a small vocabulary: shapes only)."""
    cfg, state = weights.dummy_weights(preset(name, num_layers=1, vocab_size=256))
    model = LlamaModel.from_state_dict(cfg, state)  # a missing or unread tensor would raise
    assert (model.decoder_layers[0].qkv_bias is not None) == cfg.qkv_bias
    assert (model.decoder_layers[0].q_norm is not None) == cfg.qk_norm


def test_llama3_rope_equals_transformers_and_llama_cpp():
    """Llama-3.1's scaled frequencies: transformers' bits from config.json, llama.cpp's rope_freqs form within
    float32 rounding."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from minisched.model.rope import inv_freq

    hf_cfg = transformers.LlamaConfig(**REAL_CONFIGS["llama3.1-8b"])
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    cfg = preset("llama3.1-8b")
    assert torch.equal(inv_freq(cfg), want)
    factors = F.llama3_rope_factors(hf_cfg)
    from dataclasses import replace

    gguf_form = inv_freq(replace(cfg, rope_scaling=RopeFreqFactors(tuple(factors.tolist()))))
    torch.testing.assert_close(gguf_form, want, rtol=1e-6, atol=0)
    plain = inv_freq(replace(cfg, rope_scaling=None))
    assert (plain != want).sum() > 16  # the scaling moves most frequencies
