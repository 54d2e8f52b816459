"""Detokenization: a request's final text, and the incremental text of a stream.

`final_text(...)` decodes a finished request's tokens once: cut before the first stop string
when it ended on one (or after it, with `include_stop_str_in_output`), special tokens dropped
unless `skip_special_tokens=False`. `IncrementalDetokenizer.add(new_ids)` returns the text that
is safe to send now:

- it decodes a small window of recent tokens, not the whole output (vLLM's offsets: the
  window starts at the previous read position, so each call costs O(new tokens));
- it waits while the text ends in an incomplete UTF-8 sequence (U+FFFD);
- it holds back the last `max(len(stop)) - 1` characters, which may be the start of a
  stop string (the engine checks stop strings; a stop string can only complete within
  that tail, so nothing of it is ever sent).

`finish(reason, last_ids)` takes the finishing update's tokens (never pass them to `add`: the
token that completes a stop string must not release held-back text) and returns the rest of
`final_text`. Used by `Engine.stream` and by the server (which detokenizes on the HTTP side).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def final_text(
    tokenizer,
    ids: Sequence[int],
    reason: str | None,
    stop: Sequence[str] = (),
    *,
    include_stop: bool = False,
    skip_special_tokens: bool = True,
) -> str:
    text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    if reason == "stop_str":
        hits = [(text.find(s), s) for s in stop if s in text]
        if hits:
            at, s = min(hits)
            text = text[: at + len(s)] if include_stop else text[:at]
    return text


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer, stop: Sequence[str] = (), *, include_stop: bool = False, skip_special_tokens: bool = True
    ):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.include_stop = include_stop
        self.skip_special = skip_special_tokens
        self.hold = max(map(len, self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # decoded so far (sent + held back)
        self.sent = 0  # characters of `text` already sent
        self._prefix = 0  # token offsets of the decode window
        self._read = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add(self, new_ids: Iterable[int]) -> str:
        self.ids.extend(new_ids)
        before = self._decode(self.ids[self._prefix : self._read])
        window = self._decode(self.ids[self._prefix :])
        if len(window) > len(before) and not window.endswith("\ufffd"):
            self.text += window[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)
        safe = len(self.text) - self.hold
        if safe <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent : safe], safe
        return delta

    def finish(self, reason: str | None, last_ids: Iterable[int] = ()) -> str:
        """The unsent rest of the final text (`reason`: the engine's FinishReason value)."""
        self.ids.extend(last_ids)
        final = final_text(
            self.tokenizer,
            self.ids,
            reason,
            self.stop,
            include_stop=self.include_stop,
            skip_special_tokens=self.skip_special,
        )
        sent = self.text[: self.sent]
        self.text = final
        if not final.startswith(sent):  # cannot happen with byte-level BPE; never resend
            return ""
        delta, self.sent = final[len(sent) :], len(final)
        return delta
