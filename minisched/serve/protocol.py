"""The OpenAI protocol as pydantic models: request bodies (validated), response bodies, the error body.

Request bodies are strict (`strict=True`: no "0.5" for a number, no `true` for an int) and
reject unknown fields (`extra="forbid"`), as OpenAI's API does ("Unrecognized request
argument supplied"). Accepted beyond OpenAI's fields, as vLLM and SGLang accept them:
`top_k`, `ignore_eos`, `return_token_ids` (completions: the generated token ids in each
choice, for exact comparisons). OpenAI fields this server cannot honour are accepted only
at their neutral value and are a 400 otherwise: `n` > 1, `logprobs`, `echo`, `best_of` > 1,
non-zero penalties, a non-empty `logit_bias`, `tools`, a non-text `response_format`.
`user`, `metadata` and `store` are accepted and ignored.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP = 4  # as OpenAI


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _GenerationFields(_Body):
    """The fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: Optional[float] = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: Optional[int] = Field(None, ge=-1)
    seed: Optional[int] = Field(None, ge=0, lt=2**64)
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(1, ge=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: Optional[dict[str, float]] = None
    ignore_eos: bool = False
    user: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    store: Optional[bool] = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return v

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, v):
        if v == 0:
            raise ValueError("top_k must be -1 (off) or >= 1")
        return v

    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def unsupported(self) -> Optional[tuple[str, str]]:
        """(param, message) for the first valid OpenAI field set to what this server cannot do."""
        checks = [
            ("n", self.n != 1, "n > 1 is not supported; send n separate requests"),
            ("presence_penalty", self.presence_penalty != 0, "presence_penalty is not supported (only 0)"),
            ("frequency_penalty", self.frequency_penalty != 0, "frequency_penalty is not supported (only 0)"),
            ("logit_bias", bool(self.logit_bias), "logit_bias is not supported"),
        ]
        checks += self._unsupported_extra()
        return next(((param, msg) for param, bad, msg in checks if bad), None)

    def _unsupported_extra(self) -> list[tuple[str, bool, str]]:
        return []


class CompletionRequest(_GenerationFields):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool = False
    best_of: int = Field(1, ge=1)
    logprobs: Optional[int] = Field(None, ge=0, le=5)
    suffix: Optional[str] = None
    return_token_ids: bool = False

    def _unsupported_extra(self) -> list[tuple[str, bool, str]]:
        return [
            ("echo", self.echo, "echo is not supported"),
            ("best_of", self.best_of != 1, "best_of > 1 is not supported"),
            ("logprobs", bool(self.logprobs), "logprobs are not supported"),
            ("suffix", bool(self.suffix), "suffix is not supported"),
        ]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]
    name: Optional[str] = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ResponseFormat(_Body):
    type: Literal["text"]  # json_object / json_schema: a 400 (no constrained decoding)


class ChatCompletionRequest(_GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None

    def _unsupported_extra(self) -> list[tuple[str, bool, str]]:
        return [
            ("logprobs", self.logprobs or bool(self.top_logprobs), "logprobs are not supported"),
            ("tools", bool(self.tools), "tools are not supported"),
            ("tool_choice", self.tool_choice not in (None, "none", "auto"), "tool_choice is not supported"),
        ]

    def max_new_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# -- responses (plain models: built by the server, never parsed from clients) ----------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: Optional[str] = None
    token_ids: Optional[list[int]] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: Optional[str] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "minisched"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- errors -------------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    """Raised by the handlers; answered with OpenAI's error body (`app.py`)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: Optional[str] = None,
        code: Optional[str] = None,
        headers: Optional[dict[str, str]] = None,
    ):
        super().__init__(message)
        self.status, self.headers = status, headers
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)

    def body(self) -> dict:
        return ErrorResponse(error=self.info).model_dump()
