"""The OpenAI protocol as pydantic models: request bodies (validated), response bodies, the error body.

Known fields are strict (`strict=True`: no "0.5" for a number, no `true` for an int) and range
checked: a malformed known field is a 400. Accepted beyond OpenAI's fields, as vLLM and SGLang
accept them: `top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `priority`, `stop_token_ids`,
`ignore_eos`, `skip_special_tokens`, `include_stop_str_in_output`, SGLang's `regex` and `ebnf`,
and `return_token_ids` (completions: each choice's generated token ids). Unknown fields --
vendor extras of other servers -- are accepted and ignored, as vLLM does, and logged once per
name (`ignored_fields`). What this server cannot honour is a 400: `best_of` other than `n`,
`suffix`, `tools`, a `tool_choice` that calls one. `user`, `metadata` and `store` are accepted
and ignored. docs/serving.md has the table against vLLM's and SGLang's.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from minisched.sched.sampling_params import Grammar

MAX_STOP = 4  # as OpenAI
MAX_N = 64  # choices per prompt (each is a request in the engine)
log = logging.getLogger("minisched.serve")
_LOGGED: set[str] = set()


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Lenient(BaseModel):
    """A top-level request body: unknown (vendor) fields are accepted and ignored."""

    model_config = ConfigDict(extra="allow", strict=True)

    def ignored_fields(self) -> list[str]:
        """The unknown fields of this request; each name is logged once per process."""
        names = sorted(self.model_extra or {})
        new = [n for n in names if n not in _LOGGED]
        if new:
            _LOGGED.update(new)
            log.warning("ignoring request fields this server does not know: %s", ", ".join(new))
        return names


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk


class JSONSchema(_Body):
    name: str = "schema"
    schema_: dict[str, Any] = Field(alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchema] = None


class SamplingFields(Lenient):
    """The sampling fields OpenAI's bodies and SGLang's `sampling_params` share, with one set of bounds (the
    OpenAI routes'; SGLang's own server only asks for a finite temperature >= 0). `shared_sampling` maps them to
    SamplingParams' fields (serve/entry.py); None: the surface's default."""

    temperature: Optional[float] = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: Optional[float] = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    top_k: Optional[int] = Field(default=None, ge=-1)
    min_p: float = Field(default=0.0, ge=0, le=1, allow_inf_nan=False)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2, allow_inf_nan=False)
    repetition_penalty: float = Field(default=1.0, gt=0, le=10, allow_inf_nan=False)
    logit_bias: Optional[dict[str, float]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    regex: Optional[str] = None  # SGLang: constrain the output to this regex
    ebnf: Optional[str] = None  # SGLang: ... or to this EBNF grammar

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

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v):
        for key, bias in (v or {}).items():
            if not (key.isascii() and key.isdigit()):  # "²".isdigit() is True, int("²") fails
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_ids(cls, v):
        if any(t < 0 for t in v or ()):
            raise ValueError("stop_token_ids must be >= 0")
        return v

    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def grammar(self) -> Optional[Grammar]:
        """The structured output asked for, or None; a 400 for two at once."""
        asked = [*self._schema_grammars()]
        for kind, spec in (("regex", self.regex), ("ebnf", self.ebnf)):
            if spec is not None:
                if not spec:
                    raise APIError(400, f"{kind}: an empty grammar", param=kind, code="invalid_grammar")
                asked.append(Grammar(kind, spec))
        if len(asked) > 1:
            raise APIError(400, self.ONE_GRAMMAR, param="response_format")
        return asked[0] if asked else None

    ONE_GRAMMAR: ClassVar[str] = "give one of response_format, regex and ebnf"

    def _schema_grammars(self) -> list[Grammar]:
        return []

    def shared_sampling(self) -> dict[str, Any]:
        """SamplingParams' fields from the shared fields (the routes add their own)."""
        return dict(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            stop=self.stop_list(),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            skip_special_tokens=self.skip_special_tokens,
            grammar=self.grammar(),
        )


class _GenerationFields(SamplingFields):
    """The fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    max_tokens: Optional[int] = Field(None, ge=1)
    seed: Optional[int] = Field(None, ge=0, lt=2**64)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    min_tokens: int = Field(0, ge=0)
    priority: int = Field(0, ge=-(2**31), lt=2**31)  # vLLM / SGLang: lower = more urgent (vLLM's order)
    include_stop_str_in_output: bool = False
    response_format: Optional[ResponseFormat] = None
    user: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    store: Optional[bool] = None

    def _schema_grammars(self) -> list[Grammar]:
        rf = self.response_format
        if rf is None or rf.type == "text":
            return []
        if rf.type == "json_object":
            return [Grammar("json_object", "")]
        if rf.json_schema is None:
            raise APIError(400, "response_format json_schema needs a json_schema", param="response_format")
        return [Grammar("json_schema", json.dumps(rf.json_schema.schema_))]

    def to_sampling(self, *, logprobs: Optional[int] = None, prompt_logprobs: Optional[int] = None) -> dict:
        return dict(
            self.shared_sampling(),
            seed=self.seed,
            min_tokens=self.min_tokens,
            priority=self.priority,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def unsupported(self) -> Optional[tuple[str, str]]:
        """(param, message) for the first valid field set to what this server cannot do."""
        return next(((param, msg) for param, bad, msg in self._unsupported() if bad), None)

    def _unsupported(self) -> list[tuple[str, bool, str]]:
        return []


class CompletionRequest(_GenerationFields):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: Optional[int] = Field(None, ge=0)  # 0: echo the prompt (its logprobs) only
    echo: bool = False
    best_of: Optional[int] = Field(None, ge=1)
    logprobs: Optional[int] = Field(None, ge=0, le=5)
    suffix: Optional[str] = None
    return_token_ids: bool = False

    def _unsupported(self) -> list[tuple[str, bool, str]]:
        return [
            ("best_of", self.best_of not in (None, self.n), "best_of other than n is not supported"),
            ("suffix", bool(self.suffix), "suffix is not supported"),
        ]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # lenient: clients echo back assistant messages with fields of their own (refusal, annotations, ...)
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None

    def _unsupported(self) -> list[tuple[str, bool, str]]:
        return [
            ("tools", bool(self.tools), "tools are not supported"),
            ("tool_choice", self.tool_choice not in (None, "none", "auto"), "tool_choice is not supported"),
            ("top_logprobs", self.top_logprobs is not None and not self.logprobs, "top_logprobs needs logprobs: true"),
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
    logprobs: Optional[dict] = None  # logprob_format.py
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
    logprobs: Optional[dict] = None  # logprob_format.py
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
