"""What one forward step hands back to the scheduler: a token per row and the log-probabilities
the rows asked for (`SamplingParams.logprobs` / `prompt_logprobs`); a verify step (speculative
decoding, spec.py) also the further tokens each row accepted. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float  # natural log, float32 log-softmax of the raw logits
    top: tuple[tuple[int, float], ...] = ()  # the most likely (token id, logprob), best first


@dataclass
class StepOutput:
    tokens: list[int]  # one per row, batch order (0 for a chunk that samples nothing)
    logprobs: Optional[list[Optional[TokenLogprob]]] = None  # per row: the sampled token's, if asked
    prompt_logprobs: Optional[list[Optional[list[TokenLogprob]]]] = None  # per row: this chunk's prompt tokens'
    more_tokens: Optional[list[list[int]]] = None  # VERIFY: per row, the accepted tokens after `tokens[b]`
    more_logprobs: Optional[list[Optional[list[TokenLogprob]]]] = None  # VERIFY: theirs, if asked
    seconds: Optional[float] = None  # the measured forward (the speculator's step-cost model, spec_cost.py)

    def __len__(self) -> int:
        return len(self.tokens)
