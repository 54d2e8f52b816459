"""What `Engine.generate` returns per request, and what `Engine.stream` yields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from minisched.sched.step_output import TokenLogprob


@dataclass
class Output:
    index: int  # the prompt's position in the call
    rid: str
    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    ttft: Optional[float] = None  # seconds from add_request to the first token
    e2e_latency: Optional[float] = None
    cached_tokens: int = 0  # prompt tokens reused from the radix cache
    num_retractions: int = 0
    choice: int = 0  # which of the prompt's n choices
    logprobs: Optional[list[TokenLogprob]] = None  # one per token, with SamplingParams.logprobs
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None  # from prompt_logprob_start (position 0: None)


@dataclass
class StreamChunk:
    index: int
    rid: str
    delta: str  # new text since the previous chunk of this request
    token_ids: list[int]  # new tokens
    finished: bool
    output: Optional[Output] = None  # set on the last chunk
    choice: int = 0
    logprobs: Optional[list[TokenLogprob]] = None  # of the new tokens, with SamplingParams.logprobs
