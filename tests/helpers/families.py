"""Tiny random-weight models of the families people run -- Qwen2/2.5, Qwen3, Mistral, Llama-3.x -- built from
transformers' own config and model classes, saved as an HF safetensors folder and written as a GGUF file the
way llama.cpp's convert_hf_to_gguf.py writes that architecture. Nothing is downloaded.

Each family's differences are switched on and randomised so that a loader that ignores one gives other tokens:
q/k/v biases (Qwen2), per-head q/k RMSNorm weights (Qwen3), the norms, rope_theta 1e6, Llama-3's `llama3`
RoPE scaling (with head_dim 16 and the real original context of 8192, its 8 frequencies fall in all three of
the scaling's bands), tied and untied embeddings, GQA ratios 4:2, 4:4 and 4:1, and a head_dim (32) with
num_heads * head_dim != hidden_size (Qwen3).

GGUF conventions (llama.cpp): tensor names from gguf-py's own map for the architecture; Mistral is written
as `llama` (llama.cpp registers MistralForCausalLM under LlamaModel); only the `llama` architecture has the
rows of Q and K (and their biases) permuted for interleaved RoPE -- qwen2 and qwen3 run NEOX RoPE in
llama.cpp and are written as they are; Llama-3's scaling is the `rope_freqs` tensor (one factor per
frequency, computed as the converter does); tied models have no `output.weight`.

The tokenizer is trained here in milliseconds on a few paragraphs, with the family's special tokens and a
chat template in its style: a byte-level BPE with the family's pre-tokenizer split (Qwen2's or Llama-3's
regex), written into the GGUF as llama.cpp's `gpt2` vocabulary; for Mistral a SentencePiece-style BPE
(a "\u2581" per space, byte fallback <0x00>..<0xFF>), written as llama.cpp's `llama` vocabulary (tokens,
scores, types; no merges: readers recover them from the scores, as for real SentencePiece files).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

# the pre-tokenizer splits of the real tokenizers (tokenizer.json), also llama.cpp's `qwen2` / `llama-bpe`
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Paged attention keeps the KV cache in fixed-size pages.",
    "A scheduler admits requests while the token budget holds; a prompt longer than the chunk is split.",
    "What is the capital of France? Paris is the capital of France, and Berlin is the capital of Germany.",
    "def f(x):\n    return x * 2 + 1\n\nprint(f(12345))\n",
    "Write a haiku about the sea: waves fold into foam, the gulls call over the grey water, salt on the wind.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14159. Don't, can't, we'll, they're, I'm, you've.",
    "héllo wörld, naïve café, 日本語のテキスト, emoji 🙂 and tabs\tand newlines\n\n",
    "You are a helpful assistant. Answer the user's question briefly and politely.",
]

QWEN_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}{{- '<|im_start|>system\\nYou are a tiny assistant.<|im_end|>\\n' }}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
MISTRAL_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{- '[INST] ' + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- message['content'] + eos_token }}{%- endif %}"
    "{%- endfor %}"
)


@dataclass(frozen=True)
class Family:
    name: str
    config_class: str  # transformers' class names
    model_class: str
    gguf_arch: str
    config: dict  # the config's fields (beyond the shared tiny shape)
    split: str | None  # the pre-tokenizer's split regex (None: GPT-2's, ByteLevel's own; SPM: SentencePiece)
    specials: tuple[str, ...]
    bos: str | None
    eos: str  # the tokenizer's eos_token
    stops: tuple[str, ...]  # generation_config.json's eos_token_id (the chat stop tokens)
    template: str

    @property
    def permutes_qk(self) -> bool:
        """llama.cpp permutes Q/K rows for interleaved RoPE only in the `llama` architecture."""
        return self.gguf_arch == "llama"


SPM = "sentencepiece"
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=384)
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")

FAMILIES: dict[str, Family] = {
    "qwen2": Family(
        "qwen2",
        "Qwen2Config",
        "Qwen2ForCausalLM",
        "qwen2",
        dict(
            num_key_value_heads=2,
            rope_theta=1e6,
            tie_word_embeddings=True,
            max_position_embeddings=32768,
            use_sliding_window=False,
            sliding_window=131072,
            rms_norm_eps=1e-6,
        ),
        QWEN2_SPLIT,
        QWEN_SPECIALS,
        None,
        "<|im_end|>",
        ("<|im_end|>", "<|endoftext|>"),
        QWEN_TEMPLATE,
    ),
    "qwen3": Family(
        "qwen3",
        "Qwen3Config",
        "Qwen3ForCausalLM",
        "qwen3",
        dict(
            num_key_value_heads=2,
            head_dim=32,
            rope_theta=1e6,
            tie_word_embeddings=False,
            max_position_embeddings=40960,
            use_sliding_window=False,
            rms_norm_eps=1e-6,
        ),
        QWEN2_SPLIT,
        QWEN_SPECIALS,
        None,
        "<|im_end|>",
        ("<|im_end|>", "<|endoftext|>"),
        QWEN_TEMPLATE,
    ),
    "mistral": Family(
        "mistral",
        "MistralConfig",
        "MistralForCausalLM",
        "llama",
        dict(
            num_key_value_heads=4,
            head_dim=16,
            vocab_size=512,  # 259 specials and bytes, then the pieces
            rope_theta=1e6,
            tie_word_embeddings=False,
            max_position_embeddings=32768,
            sliding_window=4096,
            rms_norm_eps=1e-5,
        ),
        SPM,
        ("<unk>", "<s>", "</s>"),
        "<s>",
        "</s>",
        ("</s>",),
        MISTRAL_TEMPLATE,
    ),
    "llama3": Family(
        "llama3",
        "LlamaConfig",
        "LlamaForCausalLM",
        "llama",
        dict(
            num_key_value_heads=1,
            head_dim=16,
            rope_theta=1e6,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
            tie_word_embeddings=True,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
        ),
        LLAMA3_SPLIT,
        LLAMA3_SPECIALS,
        "<|begin_of_text|>",
        "<|eot_id|>",
        ("<|end_of_text|>", "<|eot_id|>"),
        LLAMA3_TEMPLATE,
    ),
}


def train_tokenizer(family: Family):
    """A BPE of ~300 tokens with the family's split and specials (ids 0..len(specials)-1)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if family.split == SPM:
        return _spm_tokenizer(family)
    tok = Tokenizer(models.BPE())
    if family.split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(family.split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=list(family.specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    if family.bos is not None:  # Llama-3's tokenizer.json prepends BOS itself
        tok.post_processor = processors.TemplateProcessing(
            single=f"{family.bos} $A", pair=f"{family.bos} $A {family.bos} $B", special_tokens=[(family.bos, 0)]
        )
    return tok


def _spm_tokenizer(family: Family):
    """Mistral / Llama-2's shape: specials, then <0x00>..<0xFF>, then pieces ("\u2581" for a space) in merge
    order; BPE with byte fallback, Metaspace before the first piece, BOS prepended."""
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    meta = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = meta
    t.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=220, show_progress=False))
    learned = json.loads(t.to_str())["model"]
    pieces = sorted(learned["vocab"], key=learned["vocab"].get)
    tokens = list(family.specials) + [f"<0x{b:02X}>" for b in range(256)] + pieces
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learned["merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = meta
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(x, normalized=False, special=True) for x in family.specials])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{family.bos} $A", pair=f"{family.bos} $A {family.bos} $B", special_tokens=[(family.bos, 1)]
    )
    return tok


@torch.no_grad()
def randomise(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that greedy tokens depend on every part: projections ~ N(0, 1/fan_in) x 2,
    biases N(0, 0.5), every norm 1 + N(0, 0.3) (Qwen3's q/k norms included), embeddings N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        r = torch.randn(p.shape, generator=g)
        if "norm" in name:
            p.copy_(1 + 0.3 * r)
        elif name.endswith(".bias"):
            p.copy_(0.5 * r)
        elif "embed_tokens" in name:
            p.copy_(r)
        else:
            p.copy_(r * 2 / math.sqrt(p.shape[1]))


@dataclass
class TinyFamily:
    family: Family
    hf_dir: str
    gguf_path: str
    model: Any  # the transformers model (float32, eval)
    hf_tokenizer: Any  # transformers' tokenizer of hf_dir


def build(name: str, root: Path, seed: int = 0, **overrides) -> TinyFamily:
    """Family `name`'s tiny model under `root`: `root/hf` (safetensors, config, tokenizer, generation config)
    and `root/model.gguf` (float32 tensors, llama.cpp's conventions)."""
    import transformers

    family = FAMILIES[name]
    tok = train_tokenizer(family)
    cfg_cls = getattr(transformers, family.config_class)
    ids = {t: tok.token_to_id(t) for t in family.specials}
    cfg = cfg_cls(
        **{**SHAPE, **family.config, **overrides},
        bos_token_id=ids.get(family.bos) if family.bos else None,
        eos_token_id=ids[family.eos],
    )
    torch.manual_seed(seed)
    model = getattr(transformers, family.model_class)(cfg).float().eval()
    randomise(model, seed)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model.generation_config.eos_token_id = [ids[t] for t in family.stops]
    hf_dir = root / "hf"
    model.save_pretrained(hf_dir, safe_serialization=True)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=family.bos,
        eos_token=family.eos,
        unk_token="<unk>" if "<unk>" in family.specials else None,
    )
    fast.chat_template = family.template
    fast.save_pretrained(hf_dir)
    gguf_path = root / "model.gguf"
    write_gguf(model, tok, family, gguf_path)
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    return TinyFamily(family, str(hf_dir), str(gguf_path), model, hf_tok)


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py LlamaModel.permute: rows of each head interleaved for ggml's RoPE (a bias too)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(cfg) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.generate_extra_tensors: Llama-3's scaling as one factor per frequency."""
    rope = cfg.rope_parameters
    base, dim = rope["rope_theta"], cfg.head_dim
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(model, tok, family: Family, path: Path, formats: dict | None = None, extra: dict | None = None) -> None:
    """The transformers model as llama.cpp writes it (float32 tensors; `formats` maps a GGUF tensor suffix such
    as "attn_q" to a block type, quantized with gguf.quants, for the --quantize gguf tests; `extra`: more
    tensors {GGUF name: array})."""
    import gguf
    from gguf.constants import GGMLQuantizationType as T

    cfg = model.config
    arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}
    names = gguf.get_tensor_name_map(arch[family.gguf_arch], cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), family.gguf_arch)
    w.add_name(f"tiny-{family.name}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if family.gguf_arch == "llama":
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(head_dim)
    vocab = {i: t for t, i in tok.get_vocab().items()}
    specials = {tok.token_to_id(t) for t in family.specials}
    if family.split == SPM:  # llama.cpp's _set_vocab_sentencepiece: tokens, scores, types, no merges
        tokens = [vocab.get(i, f"[PAD{i}]") for i in range(cfg.vocab_size)]
        byte = {f"<0x{b:02X}>" for b in range(256)}
        types = [
            gguf.TokenType.UNKNOWN
            if t == "<unk>"
            else gguf.TokenType.CONTROL
            if i in specials
            else gguf.TokenType.BYTE
            if t in byte
            else gguf.TokenType.NORMAL
            if i in vocab
            else gguf.TokenType.UNUSED
            for i, t in enumerate(tokens)
        ]
        scores = [0.0 if ty != gguf.TokenType.NORMAL else -float(i) for i, ty in enumerate(types)]
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types([int(t) for t in types])
        w.add_unk_token_id(tok.token_to_id("<unk>"))
    else:  # llama.cpp's _set_vocab_gpt2: padded to the model's size with [PADi] (UNUSED)
        tokens = [vocab.get(i, f"[PAD{i}]") for i in range(cfg.vocab_size)]
        types = [
            gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL if i in vocab else gguf.TokenType.UNUSED
            for i in range(cfg.vocab_size)
        ]
        import json

        merges = json.loads(tok.to_str())["model"]["merges"]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(
            {"qwen2": "qwen2", "qwen3": "qwen2"}.get(family.name, "llama-bpe" if family.split else "gpt2")
        )
        w.add_token_list(tokens)
        w.add_token_types([int(t) for t in types])
        w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    if family.bos is not None:
        w.add_bos_token_id(tok.token_to_id(family.bos))
    w.add_add_bos_token(family.bos is not None)
    w.add_eos_token_id(tok.token_to_id(family.eos))
    w.add_chat_template(family.template)
    if family.name == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg))
    formats = formats or {}
    state = model.state_dict()
    for hf_name, t in state.items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        t = t.detach().float()
        if family.permutes_qk and (".q_proj." in hf_name or ".k_proj." in hf_name):
            t = llama_cpp_permute(t, cfg.num_attention_heads if ".q_proj." in hf_name else cfg.num_key_value_heads)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        a = t.numpy()
        fmt = next((f for part, f in formats.items() if name.split(".")[-2] == part), T.F32)
        if fmt == T.F32 or a.ndim != 2:
            w.add_tensor(name, a)
        else:
            from gguf.quants import quantize

            w.add_tensor(name, quantize(a, fmt), raw_dtype=fmt)
    for name, a in (extra or {}).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation (no stop token)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()
