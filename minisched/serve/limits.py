"""The server's bounds: the queue, and one request's; each a `minisched serve` option (its field's flag),
each a clear 4xx naming it (`check`).

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

import json
from dataclasses import dataclass
from typing import Optional

from minisched.base.flags import OWN, byte_size, flag
from minisched.serve import protocol as p

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

    def check(self, body, vocab_size: int) -> None:
        """APIError(400) for the first bound `body` (a completion or chat request) exceeds."""
        choices = body.n * (num_prompts(body.prompt) if isinstance(body, p.CompletionRequest) else 1)
        if choices > self.choices:
            what = "prompts x n" if isinstance(body, p.CompletionRequest) else "n"
            raise _limit(
                f"this request asks for {choices} choices ({what}); at most {self.choices} per request",
                "n",
                "--max-choices-per-request",
            )
        if isinstance(body, p.ChatCompletionRequest) and len(body.messages) > self.max_messages:
            raise _limit(f"{len(body.messages)} messages; at most {self.max_messages}", "messages", "--max-messages")
        longest = max(map(len, body.stop_list()), default=0)
        if longest > self.max_stop_chars:
            raise _limit(
                f"a stop sequence of {longest} characters; at most {self.max_stop_chars}", "stop", "--max-stop-chars"
            )
        bias = body.logit_bias or {}
        if len(bias) > self.max_logit_bias:
            raise _limit(
                f"{len(bias)} logit_bias entries; at most {self.max_logit_bias}", "logit_bias", "--max-logit-bias"
            )
        bad = next((k for k in bias if int(k) >= vocab_size), None)
        if bad is not None:
            raise p.APIError(
                400, f"logit_bias: token id {bad} is outside the vocabulary ({vocab_size})", param="logit_bias"
            )
        bad = next((t for t in body.stop_token_ids or () if t >= vocab_size), None)
        if bad is not None:
            raise p.APIError(
                400, f"stop_token_ids: token id {bad} is outside the vocabulary ({vocab_size})", param="stop_token_ids"
            )
        for param, spec in (("regex", body.regex), ("ebnf", body.ebnf), ("response_format", _schema_text(body))):
            size = len(spec.encode("utf-8", "replace")) if spec else 0
            if size > self.max_grammar_bytes:
                raise _limit(
                    f"a grammar of {size} bytes; at most {self.max_grammar_bytes}", param, "--max-grammar-bytes"
                )


def num_prompts(prompt) -> int:
    """Prompts in a completion request's `prompt` (a string or token ids: one)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1


def _schema_text(body) -> str:
    rf = body.response_format
    if rf is None or rf.json_schema is None:
        return ""
    return json.dumps(rf.json_schema.schema_)


def _limit(message: str, param: str, option: str) -> p.APIError:
    return p.APIError(400, f"{param}: {message} (the server's {option})", param=param, code="limit_exceeded")
