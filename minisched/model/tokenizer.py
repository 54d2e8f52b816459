"""Tokenizer: built with `tokenizers` from a GGUF's vocabulary, or an HF directory's `tokenizer.json`.

From a GGUF, as transformers builds it (`tokenizer.ggml.model`):
  gpt2    byte-level BPE over the file's vocab and merges, no prefix/suffix, ByteLevel decoding; the split
          before BPE by `tokenizer.ggml.pre`: Qwen2's regex (`qwen2`), Llama-3's (`llama-bpe`, `llama3`), else
          GPT-2's, ByteLevel's own;
  llama   SentencePiece BPE (Llama 2, Mistral 7B): merges recovered from the vocabulary's scores, byte
          fallback, a "▁" for each space and before the text (`tokenizer.ggml.add_space_prefix`).
Tokens marked CONTROL (type 3) are special (`<|im_start|>` stays whole, decoding drops it), USER_DEFINED (4)
plain added tokens (`<think>`); `tokenizer.ggml.add_bos_token` prepends BOS (a post-processor) to a
prompt -- not to a rendered chat, whose template writes its own.

Known difference, on purpose: SmolLM2's GGUF says `tokenizer.ggml.pre = smollm`, for which
llama.cpp splits digits one by one before BPE. transformers ignores that pre-tokenizer
type, and we match transformers (greedy output must equal HF token for token), so text with
multi-digit numbers tokenizes differently here than in llama.cpp.

From an HF directory: tokenizer.json as it is (its normalizer, split and post-processor: Llama-3's and
Mistral's add BOS to a prompt), the chat template and the special tokens from tokenizer_config.json (or
chat_template.jinja).

Stop tokens (`stop_token_ids`, which the engine adds to every request): the EOS, and the model's other
end-of-turn tokens -- config.json's and generation_config.json's `eos_token_id` lists (Llama-3.1's
<|eot_id|> and <|eom_id|>, Qwen's <|endoftext|>), as vLLM and SGLang stop; a GGUF's eot / eom ids and the
control tokens llama.cpp stops at by name (END_OF_TURN).

Chat templates are rendered with jinja2 as transformers renders them (the sandbox, trim_blocks,
lstrip_blocks, loop controls, its `tojson`, `raise_exception`, `strftime_now`), with `messages`,
`add_generation_prompt`, `bos_token`, `eos_token` and any extra variables (`tools`, `enable_thinking`).
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Optional

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

if TYPE_CHECKING:
    import jinja2

CONTROL, USER_DEFINED = 3, 4
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
GGUF_SPLITS = {"qwen2": QWEN2_SPLIT, "llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "llama-v3": LLAMA3_SPLIT}
SPIECE_SPACE = "\u2581"
# control tokens llama.cpp ends generation at by their text, whatever the file's eos id (llama-vocab.cpp)
END_OF_TURN = {"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|endoftext|>", "<|end|>", "<end_of_turn>"}


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@functools.lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in _bytes_to_unicode().items()}


def _spiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """A SentencePiece vocabulary's BPE merges, best score first (transformers' generate_merges): every split
    of a token into two tokens of the vocabulary is a merge ranked by the token's score."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for token, score in zip(tokens, scores):
        pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        merges += [(a, b, score) for a, b in pairs]
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _int_list(v: Any) -> list[int]:
    return [int(t) for t in (v if isinstance(v, list) else [v]) if isinstance(t, int)]


class MiniTokenizer:
    def __init__(
        self,
        tok: Tokenizer,
        *,
        eos_token_id: int | None,
        bos_token_id: int | None = None,
        chat_template: str | None = None,
        stop_token_ids: Iterable[int] = (),
        spiece: bool = False,
    ):
        self.tok = tok
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        # the EOS first, then the model's other end-of-turn tokens, each once
        stops = ([] if eos_token_id is None else [eos_token_id]) + list(stop_token_ids)
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(stops))
        self.spiece = spiece  # the vocabulary's spelling: SentencePiece's ("\u2581", <0xAB>), else byte-level BPE
        self._template: Optional[jinja2.Template] = None  # compiled on first use
        self._special: set[int] | None = None

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> MiniTokenizer:
        model = meta.get("tokenizer.ggml.model")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if model == "gpt2":
            tok, alphabet = cls._gguf_byte_level(meta, tokens), set(_bytes_to_unicode().values())
        elif model == "llama":
            tok, alphabet = cls._gguf_spiece(meta, tokens), None
        else:
            raise ValueError(
                f"GGUF tokenizer {model!r} is not supported (byte-level BPE 'gpt2' and SentencePiece 'llama' are)"
            )
        tok.add_special_tokens(
            [
                AddedToken(t, normalized=False, special=True)
                for t, ty in zip(tokens, types)
                if ty == CONTROL and (alphabet is None or set(t) <= alphabet)  # else a mislabel (transformers)
            ]
        )
        vocab = tok.get_vocab()
        tok.add_tokens(
            [AddedToken(t, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED and t in vocab]
        )
        bos = meta.get("tokenizer.ggml.bos_token_id")
        if meta.get("tokenizer.ggml.add_bos_token", model == "llama") and bos is not None:
            name = tokens[bos]
            tok.post_processor = processors.TemplateProcessing(
                single=f"{name} $A", pair=f"{name} $A {name} $B", special_tokens=[(name, bos)]
            )
        return cls(
            tok,
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
            bos_token_id=bos,
            chat_template=meta.get("tokenizer.chat_template"),
            stop_token_ids=_int_list([meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")])
            + [i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == CONTROL and t in END_OF_TURN],
            spiece=model == "llama",
        )

    @staticmethod
    def _gguf_byte_level(meta: dict, tokens: list[str]) -> Tokenizer:
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {
            (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
            for i, t in enumerate(tokens)
        }
        merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges", [])]
        tok = Tokenizer(
            BPE(
                vocab=vocab,
                merges=merges,
                dropout=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
            )
        )
        split = GGUF_SPLITS.get(meta.get("tokenizer.ggml.pre", ""))
        if split is None:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        else:
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        tok.decoder = decoders.ByteLevel()
        return tok

    @staticmethod
    def _gguf_spiece(meta: dict, tokens: list[str]) -> Tokenizer:
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        merges = meta.get("tokenizer.ggml.merges")
        pairs = [tuple(m.split(" ")) for m in merges] if merges else _spiece_merges(tokens, scores)
        vocab = {t: i for i, t in enumerate(tokens)}
        tok = Tokenizer(BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True, dropout=None))
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPIECE_SPACE, prepend_scheme="first" if prefix else "never", split=False
        )
        steps = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix else []))
        return tok

    @classmethod
    def from_gguf(cls, path: str) -> MiniTokenizer:
        from minisched.model.gguf_file import GGUFFile

        return cls.from_gguf_metadata(GGUFFile(path).metadata)

    @classmethod
    def from_hf_dir(cls, path: str) -> MiniTokenizer:
        with open(os.path.join(path, "tokenizer.json"), encoding="utf-8") as f:
            text = f.read()
        tok = Tokenizer.from_str(text)
        byte_fallback = bool(json.loads(text).get("model", {}).get("byte_fallback"))  # SentencePiece's spelling

        def read(name: str) -> dict:
            file = os.path.join(path, name)
            if not os.path.exists(file):
                return {}
            with open(file) as f:
                return json.load(f)

        cfg = read("tokenizer_config.json")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # the older named form: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.exists(jinja):
            with open(jinja) as f:
                template = f.read()

        def tid(name):
            t = cfg.get(name)
            t = t.get("content") if isinstance(t, dict) else t
            return tok.token_to_id(t) if t else None

        model_eos = _int_list(read("config.json").get("eos_token_id"))
        stops = model_eos + _int_list(read("generation_config.json").get("eos_token_id"))
        eos = tid("eos_token")
        return cls(
            tok,
            eos_token_id=eos if eos is not None else (model_eos[0] if model_eos else None),
            bos_token_id=tid("bos_token"),
            chat_template=template,
            stop_token_ids=stops,
            spiece=byte_fallback,
        )

    @classmethod
    def byte_level(cls, vocab_size: int = 512) -> MiniTokenizer:
        """A trivial tokenizer for random-weight models: ids 3..258 are bytes; 0 pad, 1 bos, 2 eos."""
        return _ByteTokenizer(vocab_size)

    # -- use -----------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A prompt's ids; with `add_special_tokens`, as the model's tokenizer adds them (a BOS for Llama-3)."""
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self.tok.id_to_token(i)

    def token_bytes(self, i: int) -> bytes:
        """The bytes token `i` stands for (the API's `bytes`; structured outputs' vocabulary); b"" for a
        special or unknown id."""
        if self._special is None:
            self._special = {i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}
        tok = self.tok.id_to_token(i)
        if tok is None or i in self._special:
            return b""
        if self.spiece:  # SentencePiece: "▁" is a space, <0xAB> a byte
            if len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
                return bytes([int(tok[3:5], 16)])
            return tok.replace(SPIECE_SPACE, " ").encode("utf-8")
        dec = _unicode_to_bytes()
        return bytes(dec[c] for c in tok) if all(c in dec for c in tok) else tok.encode("utf-8")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **variables) -> str:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        if self._template is None:
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            # the environment transformers renders chat templates in
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = _strftime_now
            self._template = env.from_string(self.chat_template)
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"chat messages must be dicts with 'role' and 'content', got {m!r}")
        name = lambda i: self.id_to_token(i) if i is not None else ""  # noqa: E731
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=name(self.bos_token_id),
            eos_token=name(self.eos_token_id),
            **variables,
        )

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """A rendered chat's ids: the template writes the special tokens (BOS included), none are added."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)


def _raise(msg):
    raise ValueError(msg)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' tojson (jinja2's escapes HTML characters)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _ByteTokenizer(MiniTokenizer):
    def __init__(self, vocab_size: int):
        if vocab_size < 259:
            raise ValueError("the byte tokenizer needs vocab_size >= 259")
        self._vocab = vocab_size
        self.eos_token_id, self.bos_token_id, self.stop_token_ids, self.spiece = 2, 1, (2,), False
        self.chat_template = (
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}"
        )
        self._template = None

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + 3 for b in text.encode("utf-8")]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return bytes((i - 3) % 256 for i in ids if 3 <= i < 259 or not skip_special_tokens).decode("utf-8", "replace")

    def id_to_token(self, i: int) -> str | None:
        return {0: "<pad>", 1: "<s>", 2: "</s>"}.get(i, chr(i - 3) if 3 <= i < 259 else f"<{i}>")

    def token_bytes(self, i: int) -> bytes:
        return bytes([i - 3]) if 3 <= i < 259 else b""


def load_tokenizer(spec: str | None) -> MiniTokenizer:
    """The tokenizer that goes with a model spec (see minisched.model.weights.resolve)."""
    from minisched.model import weights
    from minisched.model.config import preset

    kind, where = weights.resolve(spec)
    if kind == "gguf":
        return MiniTokenizer.from_gguf(where)
    if kind == "hf":
        return MiniTokenizer.from_hf_dir(where)
    return MiniTokenizer.byte_level(preset(where).vocab_size)
