"""Tokenizer: byte-level BPE built with `tokenizers` from a GGUF's vocab/merges, or an HF `tokenizer.json`.

Built to match transformers' GGUF conversion (`GPT2Tokenizer` over the file's vocab and merges):
BPE without prefix/suffix, a ByteLevel pre-tokenizer with the GPT-2 split regex and no
prefix space, ByteLevel decoding, and every token the file marks CONTROL (type 3) added as
a special token so `<|im_start|>` etc. stay whole.

Known difference, on purpose: the GGUF says `tokenizer.ggml.pre = smollm`, for which
llama.cpp splits digits one by one before BPE. transformers ignores that pre-tokenizer
type, and we match transformers (greedy output must equal HF token for token), so text with
multi-digit numbers tokenizes differently here than in llama.cpp.

Chat templates are rendered with jinja2 (`messages`, `add_generation_prompt`, `bos_token`, `eos_token`).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Optional

from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

if TYPE_CHECKING:
    import jinja2

CONTROL = 3


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


class MiniTokenizer:
    def __init__(
        self,
        tok: Tokenizer,
        *,
        eos_token_id: int | None,
        bos_token_id: int | None = None,
        chat_template: str | None = None,
        add_bos: bool = False,
    ):
        self.tok = tok
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self.add_bos = add_bos
        self._template: Optional[jinja2.Template] = None  # compiled on first use
        self._special: set[int] | None = None

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> MiniTokenizer:
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"only byte-level BPE ('gpt2') GGUF tokenizers are supported, got {model!r}")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
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
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        specials = [
            AddedToken(t, normalized=False, special=True)
            for t, ty in zip(tokens, types)
            if ty == CONTROL and set(t) <= alphabet
        ]
        tok.add_special_tokens(specials)
        return cls(
            tok,
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            chat_template=meta.get("tokenizer.chat_template"),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        )

    @classmethod
    def from_gguf(cls, path: str) -> MiniTokenizer:
        from minisched.model.gguf_file import GGUFFile

        return cls.from_gguf_metadata(GGUFFile(path).metadata)

    @classmethod
    def from_hf_dir(cls, path: str) -> MiniTokenizer:
        tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        cfg_path = os.path.join(path, "tokenizer_config.json")
        cfg = json.load(open(cfg_path)) if os.path.exists(cfg_path) else {}
        template = cfg.get("chat_template")
        jinja = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.exists(jinja):
            template = open(jinja).read()

        def tid(name):
            t = cfg.get(name)
            t = t.get("content") if isinstance(t, dict) else t
            return tok.token_to_id(t) if t else None

        return cls(tok, eos_token_id=tid("eos_token"), bos_token_id=tid("bos_token"), chat_template=template)

    @classmethod
    def byte_level(cls, vocab_size: int = 512) -> MiniTokenizer:
        """A trivial tokenizer for random-weight models: ids 3..258 are bytes; 0 pad, 1 bos, 2 eos."""
        return _ByteTokenizer(vocab_size)

    # -- use -----------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_token_id] + ids) if self.add_bos and self.bos_token_id is not None else ids

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
        dec = _unicode_to_bytes()
        return bytes(dec[c] for c in tok) if all(c in dec for c in tok) else tok.encode("utf-8")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            # the environment transformers renders chat templates in
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = _raise
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
        )

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt))


def _raise(msg):
    raise ValueError(msg)


class _ByteTokenizer(MiniTokenizer):
    def __init__(self, vocab_size: int):
        if vocab_size < 259:
            raise ValueError("the byte tokenizer needs vocab_size >= 259")
        self._vocab = vocab_size
        self.eos_token_id, self.bos_token_id, self.add_bos = 2, 1, False
        self.chat_template = (
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}"
        )
        self._template = None

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def encode(self, text: str) -> list[int]:
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
