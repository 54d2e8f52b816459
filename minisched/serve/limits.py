"""The server's bounds: the queue, and one request's; each a `minisched serve` option (its field's flag),
each a clear 4xx naming it (serve/entry.py checks them, for every route alike).

    limits = ServerLimits(max_queued_requests=64)     # create_app(..., limits=limits)

| option | default | why |
|---|---|---|
| `--max-queued-requests` | 512 | choices waiting for their first token beyond this: 429 + Retry-After (state.py) |
| `--max-request-body-bytes` | 32 MiB | a body is read whole before it is parsed (request_body.py: 413, counted as it arrives) |
| `--max-choices-per-request` | 256, at most the queue | prompts x n: each choice is a request in the engine and a slot of the queue |
| `--max-stop-chars` | 256 | the engine decodes a tail of 2 x the longest stop string per step, the detokenizer holds one back |
| `--max-logit-bias` | 1024 | entries of `logit_bias` (each one is applied per step) |
| `--max-messages` | 4096 | chat messages (the template renders each on the event loop) |
| `--max-grammar-bytes` | 64 KiB | a grammar is parsed on the event loop (~1.3 us a byte) and compiled in time superlinear in its size |

`--max-choices-per-request` follows the queue when it is not given: `--max-queued-requests 6` alone allows 6
choices per request; given both, a choice bound above the queue is refused (no request could ever fit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from minisched.base.flags import OWN, byte_size, flag

MIB = 1 << 20
MAX_CHOICES = 256  # --max-choices-per-request when the queue allows as many


@dataclass(frozen=True)
class ServerLimits:
    max_queued_requests: int = flag(
        512, "requests waiting for their first token beyond this get 429 + Retry-After", group=OWN
    )
    max_request_body_bytes: int = flag(32 * MIB, "bytes of a request body, larger: 413", default_words=byte_size)
    max_choices_per_request: Optional[int] = flag(  # None: MAX_CHOICES, at most the queue (`choices`)
        None,
        "prompts x n of one request: each is a request in the engine",
        type=int,
        default_words=lambda _: str(MAX_CHOICES),
    )
    max_stop_chars: int = flag(256, "characters of one stop string", default_words=str)
    max_logit_bias: int = flag(1024, "logit_bias entries", default_words=str)
    max_messages: int = flag(4096, "messages of one chat request", default_words=str)
    max_grammar_bytes: int = flag(64 * 1024, "bytes of a json_schema, regex or ebnf", default_words=byte_size)

    def __post_init__(self):
        q = self.max_queued_requests
        if not isinstance(q, int) or isinstance(q, bool) or q < 0:
            raise ValueError(f"max_queued_requests must be an int >= 0, got {q!r}")
        for name, value in vars(self).items():
            if name == "max_queued_requests" or (name == "max_choices_per_request" and value is None):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.max_choices_per_request is not None and self.max_choices_per_request > max(1, q):
            raise ValueError(
                f"max_choices_per_request ({self.max_choices_per_request}) must be <= max_queued_requests ({q}): "
                "the queue counts choices"
            )

    @property
    def choices(self) -> int:
        """Choices (prompts x n) one request may ask for: the option, else MAX_CHOICES or the queue if smaller."""
        if self.max_choices_per_request is not None:
            return self.max_choices_per_request
        return min(MAX_CHOICES, max(1, self.max_queued_requests))
