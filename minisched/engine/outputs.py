"""What `Engine.generate` returns per request, and what `Engine.stream` yields."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Output:
    index: int
    rid: str
    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    ttft: Optional[float] = None  # seconds from add_request to the first token
    e2e_latency: Optional[float] = None
    cached_tokens: int = 0
    num_retractions: int = 0


@dataclass
class StreamChunk:
    index: int
    rid: str
    delta: str  # new text since the previous chunk of this request
    token_ids: list[int]  # new tokens
    finished: bool
    output: Optional[Output] = None  # set on the last chunk
