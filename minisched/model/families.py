"""The model families minisched loads, and each one's config (an HF config.json, a GGUF header) read into a ModelConfig.

  family   HF architecture       GGUF architecture   its pieces (ModelConfig fields; model/llama.py computes them)
  llama    LlamaForCausalLM      llama               Llama 2/3.x, SmolLM2: rope_scaling "llama3" (Llama-3.1/3.2)
  mistral  MistralForCausalLM    llama               Llama's, with a sliding window (below)
  qwen2    Qwen2ForCausalLM      qwen2               qkv_bias (Qwen2, Qwen2.5)
  qwen3    Qwen3ForCausalLM      qwen3               qk_norm (Qwen3 dense)

Anything else -- another architecture, an option these families have that the model does not compute
(another RoPE scaling, attention_bias's o_proj bias, mlp_bias, partial rotary, another activation) -- is a
one-line ValueError naming it, never a model that loads and computes something else.

A sliding window (Mistral-7B-v0.1's 4096, Qwen2's with use_sliding_window) limits the context to the window:
the attention here is full, and up to the window full and sliding attention are the same.

llama.cpp writes Mistral as `llama`, and permutes the rows of Q and K (and their biases) for its
interleaved RoPE in that architecture only (`permutes_qk`); qwen2 and qwen3 run NEOX (half-rotation) RoPE
there and are stored as HF has them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from minisched.model.config import Llama3RopeScaling, ModelConfig, RopeFreqFactors, RopeScaling

if TYPE_CHECKING:
    from minisched.model.gguf_file import GGUFFile


@dataclass(frozen=True)
class Family:
    name: str  # HF's model_type
    hf_architecture: str
    gguf_architecture: str
    qkv_bias: bool = False  # always (the config has no switch for it)
    qk_norm: bool = False


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", "LlamaForCausalLM", "llama"),
        Family("mistral", "MistralForCausalLM", "llama"),
        Family("qwen2", "Qwen2ForCausalLM", "qwen2", qkv_bias=True),
        Family("qwen3", "Qwen3ForCausalLM", "qwen3", qk_norm=True),
    )
}
GGUF_FAMILIES = {"llama": FAMILIES["llama"], "qwen2": FAMILIES["qwen2"], "qwen3": FAMILIES["qwen3"]}
SUPPORTED = ", ".join(f.hf_architecture for f in FAMILIES.values())


def permutes_qk(gguf_architecture: str) -> bool:
    """llama.cpp stores this architecture's Q/K rows permuted for interleaved RoPE."""
    return gguf_architecture == "llama"


def hf_architecture(name: str) -> str:
    """The HF class name of a family (`ModelConfig.architecture`), for /model_info."""
    family = FAMILIES.get(name)
    return family.hf_architecture if family else name


def hf_family(d: dict) -> Family:
    archs = d.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    for family in FAMILIES.values():
        if arch == family.hf_architecture or (arch is None and d.get("model_type") == family.name):
            return family
    raise ValueError(
        f"unsupported architecture {arch or d.get('model_type')!r} (model_type {d.get('model_type')!r}): "
        f"minisched loads {SUPPORTED}"
    )


def _refuse(d: dict, family: Family) -> None:
    """The options of these families that the model does not compute."""
    act = d.get("hidden_act", d.get("hidden_activation", "silu"))
    if act != "silu":
        raise ValueError(f"{family.hf_architecture} with hidden_act {act!r} is not supported (silu only)")
    if d.get("mlp_bias"):
        raise ValueError(f"{family.hf_architecture} with mlp_bias=true is not supported")
    if d.get("attention_bias") and not family.qkv_bias:
        raise ValueError(f"{family.hf_architecture} with attention_bias=true (an o_proj bias) is not supported")
    partial = (d.get("rope_parameters") or {}).get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"{family.hf_architecture} with partial_rotary_factor {partial} is not supported")


def hf_rope(d: dict) -> tuple[float, Optional[RopeScaling]]:
    """(rope_theta, scaling) from a config.json, old style (rope_theta + rope_scaling) or transformers 5's
    rope_parameters."""
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or params
    theta = float(d.get("rope_theta") or params.get("rope_theta") or 10000.0)
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return theta, None
    if kind == "llama3":
        original = scaling.get("original_max_position_embeddings") or d.get("original_max_position_embeddings")
        return theta, Llama3RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position=int(original or 8192),  # the original Llama-3's context
        )
    raise ValueError(f"RoPE scaling {kind!r} is not supported (default and llama3 are)")


def sliding_window(d: dict) -> Optional[int]:
    """The window a config slides attention over, if any layer does."""
    window = d.get("sliding_window")
    types = d.get("layer_types")
    slides = "sliding_attention" in types if types else d.get("use_sliding_window", True)
    return int(window) if window and slides else None


def config_from_hf(d: dict) -> ModelConfig:
    """A config.json's ModelConfig (ValueError, one line, for what the model cannot compute)."""
    family = hf_family(d)
    _refuse(d, family)
    heads = d["num_attention_heads"]
    eos = d.get("eos_token_id")
    theta, scaling = hf_rope(d)
    max_position = int(d.get("max_position_embeddings", 4096))
    window = sliding_window(d)
    return ModelConfig(
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        intermediate_size=d["intermediate_size"],
        rope_theta=theta,
        rms_eps=float(d.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        max_position=min(max_position, window) if window else max_position,
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=(eos[0] if eos else None) if isinstance(eos, list) else eos,
        architecture=family.name,
        qkv_bias=family.qkv_bias,
        qk_norm=family.qk_norm,
        rope_scaling=scaling,
    )


def gguf_family(arch: Any) -> Family:
    if arch not in GGUF_FAMILIES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}: minisched loads {', '.join(GGUF_FAMILIES)} "
            f"(Llama, Mistral and SmolLM2 are written as llama)"
        )
    return GGUF_FAMILIES[arch]


def config_from_gguf(gf: GGUFFile) -> ModelConfig:
    """A GGUF file's ModelConfig, from its header and its tensor names (biases, q/k norms, rope_freqs)."""
    meta = gf.metadata
    arch = meta.get("general.architecture")
    family = gguf_family(arch)

    def g(key: str, default: Any = None) -> Any:  # a missing key fails in int(): the loader's one-line error
        return meta.get(f"{arch}.{key}", default)

    hidden, heads = int(g("embedding_length")), int(g("attention.head_count"))
    head_dim = int(g("attention.key_length", hidden // heads))
    vocab = int(g("vocab_size") or len(meta["tokenizer.ggml.tokens"]))
    kind = g("rope.scaling.type")
    if kind not in (None, "none"):
        raise ValueError(f"GGUF RoPE scaling {kind!r} is not supported (none, or llama3's rope_freqs)")
    rotary = g("rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        raise ValueError(f"partial RoPE ({rotary} of {head_dim} dimensions) is not supported")
    freqs = gf.tensors.get("rope_freqs.weight")
    scaling = None if freqs is None else RopeFreqFactors(tuple(float(f) for f in freqs.dequantize().reshape(-1)))
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=int(g("block_count")),
        num_heads=heads,
        num_kv_heads=int(g("attention.head_count_kv", heads)),
        head_dim=head_dim,
        intermediate_size=int(g("feed_forward_length")),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        rms_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in gf.tensors,
        max_position=int(g("context_length", 4096)),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        architecture=family.name,
        # llama.cpp's llama architecture takes q/k/v biases where the file has them
        qkv_bias=family.qkv_bias or "blk.0.attn_q.bias" in gf.tensors,
        qk_norm=family.qk_norm,
        rope_scaling=scaling,
    )
