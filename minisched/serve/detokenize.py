"""Incremental detokenization on the HTTP side (the engine loop only moves token ids).

`IncrementalDetokenizer.add(new_ids)` returns the text that is safe to send now:

- it decodes a small window of recent tokens, not the whole output (vLLM's offsets: the
  window starts at the previous read position, so each call costs O(new tokens));
- it waits while the text ends in an incomplete UTF-8 sequence (U+FFFD);
- it holds back the last `max(len(stop)) - 1` characters, which may be the start of a
  stop string (the engine checks stop strings; a stop string can only complete within
  that tail, so nothing of it is ever sent).

`finish(reason, last_ids)` takes the finishing update's tokens (never pass them to `add`: the
token that completes a stop string must not release held-back text), decodes the whole output
once and returns the rest, cut at the first stop string when the engine finished on one --
the same text as `Engine._final_text`.
"""
from __future__ import annotations

from typing import Iterable, Sequence


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.hold = max(map(len, self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # decoded so far (sent + held back)
        self.sent = 0  # characters of `text` already sent
        self._prefix = 0  # token offsets of the decode window
        self._read = 0

    def add(self, new_ids: Iterable[int]) -> str:
        self.ids.extend(new_ids)
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix:self._read])
        window = decode(self.ids[self._prefix:])
        if len(window) > len(before) and not window.endswith("\ufffd"):
            self.text += window[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
        safe = len(self.text) - self.hold
        if safe <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent:safe], safe
        return delta

    def finish(self, reason: str | None, last_ids: Iterable[int] = ()) -> str:
        """The unsent rest of the final text (`reason`: the engine's FinishReason value)."""
        self.ids.extend(last_ids)
        final = self.tokenizer.decode(self.ids)
        if reason == "stop_str":
            cuts = [final.find(s) for s in self.stop if s in final]
            if cuts:
                final = final[:min(cuts)]
        sent = self.text[:self.sent]
        self.text = final
        if not final.startswith(sent):  # cannot happen with byte-level BPE; never resend
            return ""
        delta, self.sent = final[len(sent):], len(final)
        return delta

    @property
    def sent_text(self) -> str:
        return self.text[:self.sent]
