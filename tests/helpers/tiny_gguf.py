"""A tiny Llama GGUF file (the `tiny` preset's shapes) with block-quantized tensors, for the `--quantize gguf`
and `gguf-a8` tests, and the float32 model the engine loads from it (the file dequantized)."""

from __future__ import annotations

import numpy as np
from gguf import GGUFWriter
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import quantize as gguf_quantize

from minisched.model import weights
from minisched.model.config import preset
from minisched.model.llama import LlamaModel

# tensor -> format in the tiny file: Q4_1 and Q4_0 projections, a float32 v (so qkv's parts differ and
# qkv stays float32), a Q8_0 embedding (the tied head)
FORMATS = {
    "attn_q": T.Q4_1,
    "attn_k": T.Q4_1,
    "attn_v": T.F32,
    "attn_output": T.Q4_0,
    "ffn_gate": T.Q4_1,
    "ffn_up": T.Q4_1,
    "ffn_down": T.Q8_0,
}


def write_tiny_gguf(path: str, seed: int = 0, formats: dict = FORMATS, embed: T = T.Q8_0) -> None:
    cfg = preset("tiny")
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    rng = np.random.default_rng(seed)
    w = GGUFWriter(path, "llama")
    w.add_vocab_size(cfg.vocab_size)
    w.add_embedding_length(h)
    w.add_block_count(cfg.num_layers)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_feed_forward_length(i)
    w.add_context_length(cfg.max_position)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_eps)

    def add(name: str, rows: int, cols: int, fmt: T, std: float = 0.05) -> None:
        a = (rng.standard_normal((rows, cols)) * std).astype(np.float32)
        if fmt == T.F32:
            w.add_tensor(name, a)
        else:
            w.add_tensor(name, gguf_quantize(a, fmt), raw_dtype=fmt)

    add("token_embd.weight", cfg.vocab_size, h, embed, std=1.0)
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(h)).astype(np.float32))
    shapes = {"attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, q)}
    shapes |= {"ffn_gate": (i, h), "ffn_up": (i, h), "ffn_down": (h, i)}
    for layer in range(cfg.num_layers):
        for part in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{layer}.{part}.weight", (1 + 0.1 * rng.standard_normal(h)).astype(np.float32))
        for part, (rows, cols) in shapes.items():
            add(f"blk.{layer}.{part}.weight", rows, cols, formats[part])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def fp32_model(path: str) -> LlamaModel:
    cfg, state = weights.load(path)
    return LlamaModel.from_state_dict(cfg, state)
