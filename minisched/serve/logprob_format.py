"""OpenAI's two logprob formats, from the engine's `TokenLogprob`s (natural log, raw model logits).

- /v1/completions (`logprobs: N`, N <= 5): `{"tokens": [...], "token_logprobs": [...],
  "top_logprobs": [{token: logprob, ...}, ...], "text_offset": [...]}`, one entry per token;
  with `echo` the prompt's tokens come first, the first of them with null logprob and null top.
  `text_offset` is each token's character offset in the choice's text.
- /v1/chat/completions (`logprobs: true`, `top_logprobs: k` <= 20): `{"content": [{"token",
  "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}`.

A token's string is its own decoding (special tokens included; a token that ends inside a UTF-8
character decodes to U+FFFD), its `bytes` the exact bytes it stands for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from minisched.sched.step_output import TokenLogprob


class LogprobFormatter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def token(self, i: int) -> str:
        s = self._cache.get(i)
        if s is None:
            s = self._cache[i] = self.tokenizer.decode([i], skip_special_tokens=False)
        return s

    def completion(
        self, ids: Sequence[int], entries: Sequence[Optional[TokenLogprob]], offset: int
    ) -> tuple[dict, int]:
        """The completions format for these tokens, their text starting at character `offset`;
        returns it and the offset after them (streams continue from there)."""
        tokens, lps, tops, offsets = [], [], [], []
        for i, e in zip(ids, entries):
            s = self.token(i)
            tokens.append(s)
            offsets.append(offset)
            offset += len(s)
            lps.append(None if e is None else e.logprob)
            tops.append(None if e is None else {self.token(t): lp for t, lp in e.top})
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}, offset

    def chat(self, entries: Sequence[TokenLogprob]) -> dict:
        def one(i: int, lp: float) -> dict:
            return {"token": self.token(i), "logprob": lp, "bytes": list(self.tokenizer.token_bytes(i))}

        return {
            "content": [
                {**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries
            ]
        }


def merge_completion(a: Optional[dict], b: dict) -> dict:
    """Two consecutive completion-format pieces as one."""
    if a is None:
        return b
    return {k: a[k] + b[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
