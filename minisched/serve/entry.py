"""One request entry for every generation route: /v1/completions, /v1/chat/completions and /generate read
their body into `Ask`s (one per prompt: the prompt, SamplingParams' fields) and `prepare` turns those into
`Prepared` prompts (token ids, SamplingParams) through the same checks, in this order:

1. the server's bounds (limits.py), before anything is tokenized: choices (prompts x n), chat messages, stop
   string length, logit_bias entries, grammar bytes; and token ids of `logit_bias` and `stop_token_ids`
   inside the vocabulary;
2. each grammar parsed (structured.py);
3. each prompt tokenized (text, token ids, or chat messages through the template) and checked: not empty,
   inside the vocabulary, room left in the context; its SamplingParams built, the surface's defaults
   standing in for what the body left out.

A failed check is an APIError(400) naming the body's field as the route spells it (`Surface.param`).

Each surface's defaults, in one place (the `Surface`s below; a body's value always wins):

| surface | temperature | top_p | top_k | max new tokens | whose default |
|---|---|---|---|---|---|
| POST /v1/completions | 1.0 | 1.0 | -1 (all) | 16 | OpenAI's |
| POST /v1/chat/completions | 1.0 | 1.0 | -1 (all) | the context left | OpenAI's |
| POST /generate | 1.0 | 1.0 | -1 (all) | 128 | SGLang's SamplingParams |
| Python (`SamplingParams()`, `Engine.generate`), `minisched generate` / `chat` | 0.0 (greedy) | 1.0 | -1 | 128 (chat: 256) | minisched's (sched/sampling_params.py) |

So an HTTP client that sends no temperature samples (as OpenAI's and SGLang's servers do), while the Python
API and the command line are greedy unless told otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from minisched.sched.sampling_params import Grammar, InvalidRequest, SamplingParams
from minisched.serve.limits import ServerLimits
from minisched.serve.protocol import APIError
from minisched.serve.state import Prepared, ServerState
from minisched.serve.structured import check_grammar


@dataclass(frozen=True)
class ChatPrompt:
    """A chat's messages, rendered into token ids by the model's chat template."""

    messages: list[dict[str, str]]  # {"role", "content"}


Prompt = Union[str, list[int], ChatPrompt]


@dataclass(frozen=True)
class Ask:
    """One prompt of a call as its route read the body: SamplingParams' fields (None: the surface's default)
    and the body's max new tokens (None: the surface's default)."""

    prompt: Prompt
    sampling: dict[str, Any]
    max_tokens: Optional[int] = None


OPENAI_NAMES = {"json_schema": "response_format", "json_object": "response_format", "max_new_tokens": "max_tokens"}
SGLANG_NAMES = {
    "seed": "sampling_params.sampling_seed",
    "min_tokens": "sampling_params.min_new_tokens",
    "include_stop_str_in_output": "sampling_params.no_stop_trim",
    "priority": "priority",
}


@dataclass(frozen=True)
class Surface:
    """One API's defaults for what a body leaves out, and its names for SamplingParams' fields."""

    kind: str  # the call ids' prefix (cmpl-..., chatcmpl-..., gen-...)
    max_new_tokens: Optional[int]  # when the body gives none; None: the context left
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    prefix: str = ""  # a SamplingParams field's name in the body: prefix + name, unless `names` says otherwise
    names: Mapping[str, str] = field(default_factory=dict)

    def param(self, name: str) -> str:
        """The body's field for SamplingParams' field (or a grammar kind, or "n") `name`."""
        return self.names.get(name, self.prefix + name)

    def defaults(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}


COMPLETIONS = Surface("cmpl", 16, names=OPENAI_NAMES)
CHAT = Surface("chatcmpl", None, names=OPENAI_NAMES)
GENERATE = Surface("gen", 128, prefix="sampling_params.", names=SGLANG_NAMES)


def prepare(state: ServerState, asks: list[Ask], n: int, surface: Surface, param: str) -> list[Prepared]:
    """The call's prompts, checked (the module's docstring, in its order) and ready for `state.admit`; `param`
    is the body's prompt field."""
    check_bounds(state.limits, asks, n, state.vocab_size, surface)
    seen: set[Grammar] = set()
    for ask in asks:
        grammar = ask.sampling.get("grammar")
        if grammar is not None and grammar not in seen:
            seen.add(grammar)
            check_grammar(grammar.kind, grammar.spec, surface.param(grammar.kind))  # a 400 now, never later
    return [_prepare_one(state, ask, surface, param) for ask in asks]


def check_bounds(limits: ServerLimits, asks: list[Ask], n: int, vocab_size: int, surface: Surface) -> None:
    """APIError(400) for the first of the server's bounds the call exceeds, or a token id outside the
    vocabulary in its sampling fields."""
    choices = len(asks) * n
    if choices > limits.choices:
        what = "n" if len(asks) == 1 else "prompts x n"
        raise _limit(
            f"this request asks for {choices} choices ({what}); at most {limits.choices} per request",
            surface.param("n"),
            "--max-choices-per-request",
        )
    messages = sum(len(a.prompt.messages) for a in asks if isinstance(a.prompt, ChatPrompt))
    if messages > limits.max_messages:
        raise _limit(f"{messages} messages; at most {limits.max_messages}", "messages", "--max-messages")
    for sampling in {id(a.sampling): a.sampling for a in asks}.values():  # a completion's prompts share one
        _check_fields(limits, sampling, vocab_size, surface)


def _check_fields(limits: ServerLimits, sampling: dict[str, Any], vocab_size: int, surface: Surface) -> None:
    longest = max(map(len, sampling.get("stop") or ()), default=0)
    if longest > limits.max_stop_chars:
        raise _limit(
            f"a stop sequence of {longest} characters; at most {limits.max_stop_chars}",
            surface.param("stop"),
            "--max-stop-chars",
        )
    bias = sampling.get("logit_bias") or {}
    if len(bias) > limits.max_logit_bias:
        raise _limit(
            f"{len(bias)} logit_bias entries; at most {limits.max_logit_bias}",
            surface.param("logit_bias"),
            "--max-logit-bias",
        )
    for name, ids in (("logit_bias", bias), ("stop_token_ids", sampling.get("stop_token_ids") or ())):
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            param = surface.param(name)
            raise APIError(400, f"{param}: token id {bad} is outside the vocabulary ({vocab_size})", param=param)
    grammar = sampling.get("grammar")
    size = len(grammar.spec.encode("utf-8", "replace")) if grammar is not None else 0
    if grammar is not None and size > limits.max_grammar_bytes:
        raise _limit(
            f"a grammar of {size} bytes; at most {limits.max_grammar_bytes}",
            surface.param(grammar.kind),
            "--max-grammar-bytes",
        )


def _limit(message: str, param: str, option: str) -> APIError:
    return APIError(400, f"{param}: {message} (the server's {option})", param=param, code="limit_exceeded")


def _prepare_one(state: ServerState, ask: Ask, surface: Surface, param: str) -> Prepared:
    ids = _tokens(state, ask.prompt)
    if isinstance(ask.prompt, ChatPrompt):
        param = "messages"
    n = len(ids)
    if n == 0:
        raise APIError(400, f"{param} is empty", param=param)
    bad = next((t for t in ids if not 0 <= t < state.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"{param}: token id {bad} is out of range (vocabulary of {state.vocab_size})", param=param)
    room = min(state.max_context_len, state.pool_tokens + 1) - n
    if room < 1:
        raise APIError(
            400,
            f"This model's maximum context length is {state.max_context_len} tokens; the prompt "
            f"has {n} tokens and leaves no room to generate.",
            param=param,
            code="context_length_exceeded",
        )
    want = ask.max_tokens if ask.max_tokens is not None else (surface.max_new_tokens or room)
    defaults = surface.defaults()
    given = {k: (defaults[k] if v is None and k in defaults else v) for k, v in ask.sampling.items()}
    try:
        sampling = SamplingParams(max_new_tokens=min(want, room), **given)
    except (InvalidRequest, ValueError, TypeError) as exc:
        raise APIError(400, str(exc)) from exc
    return Prepared(ids, sampling)


def _tokens(state: ServerState, prompt: Prompt) -> list[int]:
    if isinstance(prompt, str):
        return state.tokenizer.encode(prompt)
    if isinstance(prompt, ChatPrompt):
        try:
            return state.tokenizer.encode_chat(prompt.messages)
        except Exception as exc:  # the template's raise_exception (ValueError) or a jinja2 TemplateError
            raise APIError(400, f"messages: {exc}", param="messages") from exc
    return list(prompt)
