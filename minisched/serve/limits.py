"""The server's bounds on one request: each a `minisched serve` option, each a clear 4xx naming it.

    limits = ServerLimits(max_choices_per_request=256)     # create_app(..., limits=limits)
    limits.check(body, vocab_size)                           # APIError(400) before tokenizing

| option | default | why |
|---|---|---|
| `--max-request-body-bytes` | 32 MiB | a body is read whole before it is parsed (request_body.py: 413, counted as it arrives) |
| `--max-choices-per-request` | 256 | prompts x n: each choice is a request in the engine and a slot of the queue |
| `--max-stop-chars` | 256 | the engine decodes a tail of 2 x the longest stop string per step, the detokenizer holds one back |
| `--max-logit-bias` | 1024 | entries of `logit_bias` (each one is applied per step) |
| `--max-messages` | 4096 | chat messages (the template renders each on the event loop) |
| `--max-grammar-bytes` | 64 KiB | a grammar is parsed on the event loop (~1.3 us a byte) and compiled in time superlinear in its size |

Checks of values against the model (token ids outside the vocabulary) are made here too: they
need the vocabulary, which the pydantic models do not have.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from minisched.serve import protocol as p

MIB = 1 << 20


@dataclass(frozen=True)
class ServerLimits:
    max_request_body_bytes: int = 32 * MIB
    max_choices_per_request: int = 256
    max_stop_chars: int = 256
    max_logit_bias: int = 1024
    max_messages: int = 4096
    max_grammar_bytes: int = 64 * 1024

    def __post_init__(self):
        for name, value in vars(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")

    def check(self, body, vocab_size: int) -> None:
        """APIError(400) for the first bound `body` (a completion or chat request) exceeds."""
        choices = body.n * (num_prompts(body.prompt) if isinstance(body, p.CompletionRequest) else 1)
        if choices > self.max_choices_per_request:
            what = "prompts x n" if isinstance(body, p.CompletionRequest) else "n"
            raise _limit(
                f"this request asks for {choices} choices ({what}); at most {self.max_choices_per_request} per request",
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
