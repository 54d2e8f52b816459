"""`SamplingParams`: one request's sampling settings, frozen and validated (InvalidRequest).

The fields SGLang and vLLM accept, with their meanings:

- `temperature` (0: greedy), `top_k` (-1: off), `top_p`, `min_p` (drop tokens whose probability
  is below `min_p` times the most likely one's), `seed` (the request's own random stream);
- penalties, over the token ids seen so far: `repetition_penalty` (CTRL's: a seen token's logit
  is divided by it if positive, multiplied if negative; prompt and output tokens count, as in
  vLLM and transformers), `frequency_penalty` (minus penalty x count) and `presence_penalty`
  (minus penalty once) over the *output* tokens (OpenAI's definition); `logit_bias` (token id
  -> added to its logit);
- `min_tokens`: the stop tokens (EOS, `stop_token_ids`) cannot be sampled before this many
  output tokens; `max_new_tokens` (0: prefill only, fills the cache);
- `stop` strings and `stop_token_ids`, `ignore_eos`; `include_stop_str_in_output`,
  `skip_special_tokens` shape the text, not the tokens;
- `logprobs` (None: off; k >= 0: each output token's log-probability and the k most likely
  alternatives) and `prompt_logprobs` (the same for the prompt tokens from position
  `prompt_logprob_start`; position 0 has none). Log-probabilities are the model's own
  (log-softmax of the raw logits in float32, before penalties, bias and temperature: vLLM's
  default "raw_logprobs"), so they do not depend on the sampling settings;
- `grammar`: structured output (`Grammar`: a JSON schema, any JSON object, a regex or an EBNF
  grammar), enforced by masking the logits before sampling;
- `priority` (an int, default 0): the scheduling class, as vLLM spells it -- a LOWER value is
  MORE urgent (vLLM's `priority`; SGLang's default order is the reverse). Honoured only when
  the scheduler runs with `priority_scheduling` (sched/preemption.py); otherwise a non-zero
  priority is an InvalidRequest, as in vLLM.

Pure Python: nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from minisched.base.values import is_int, is_real

MAX_LOGPROBS = 20  # top alternatives per position (OpenAI's chat limit)
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "ebnf")


class InvalidRequest(ValueError):
    """Raised by `Scheduler.add_request` (and SamplingParams) for a request that can never run."""


@dataclass(frozen=True)
class Grammar:
    kind: str  # one of GRAMMAR_KINDS
    spec: str = ""  # the schema (JSON text), the regex or the EBNF; "" for json_object

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise InvalidRequest(f"grammar kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}")
        if not isinstance(self.spec, str) or (self.kind != "json_object" and not self.spec):
            raise InvalidRequest(f"a {self.kind} grammar needs a non-empty spec string")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings. `stop_token_ids` should include the model's EOS
    (the engine adds it); `ignore_eos=True` disables the stop-token check."""

    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_new_tokens: int = 128
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # also accepts a {token id: bias} dict
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprob_start: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    grammar: Grammar | None = None
    priority: int = 0  # lower = more urgent (vLLM's convention)

    def __post_init__(self) -> None:
        def bad(msg: str) -> InvalidRequest:
            return InvalidRequest(f"SamplingParams: {msg}")

        def setf(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not is_real(v):
                raise bad(f"{name} must be a finite number, got {v!r}")
            setf(name, float(v))
        if self.temperature < 0:
            raise bad(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0 <= self.min_p <= 1:
            raise bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not self.repetition_penalty > 0:
            raise bad(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise bad(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            raise bad(f"top_k must be an int, -1 or >= 1, got {self.top_k!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise bad(f"seed must be None or an int in [0, 2**64), got {self.seed!r}")
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 0:  # 0: prefill only (fills the cache)
            raise bad(f"max_new_tokens must be an int >= 0, got {self.max_new_tokens!r}")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise bad(f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {v!r}")
        if not is_int(self.priority) or not -(2**31) <= self.priority < 2**31:
            raise bad(f"priority must be an int in [-2**31, 2**31), got {self.priority!r}")
        if not is_int(self.prompt_logprob_start) or self.prompt_logprob_start < 0:
            raise bad(f"prompt_logprob_start must be an int >= 0, got {self.prompt_logprob_start!r}")
        for name in (
            "top_k",
            "seed",
            "max_new_tokens",
            "min_tokens",
            "logprobs",
            "prompt_logprobs",
            "prompt_logprob_start",
            "priority",
        ):
            if getattr(self, name) is not None:
                setf(name, int(getattr(self, name)))  # numpy ints -> int
        if isinstance(self.stop_token_ids, (str, bytes)) or not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        setf("stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} must be a bool, got {getattr(self, name)!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise bad(f"stop must be non-empty strings, got {self.stop!r}")
        setf("stop", stop)
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            pairs = tuple(sorted((int(t), float(b)) for t, b in bias if is_int(t) and t >= 0 and is_real(b)))
        except (TypeError, ValueError):
            raise bad(f"logit_bias must map token ids to finite numbers, got {self.logit_bias!r}") from None
        if len(pairs) != len(tuple(bias)) or any(not -100 <= b <= 100 for _, b in pairs):
            raise bad(f"logit_bias must map token ids (ints >= 0) to numbers in [-100, 100], got {self.logit_bias!r}")
        setf("logit_bias", pairs)
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise bad(f"grammar must be a Grammar, got {type(self.grammar).__name__}")

    # -- what a step must compute for this request -----------------------------------------------
    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0

    @property
    def can_draft(self) -> bool:
        """May a speculative step verify drafts for this request (sched/spec.py)? Not with what changes
        the logits per position: a grammar, penalties, a bias or min_tokens."""
        return self.grammar is None and not self.has_penalties and not self.logit_bias and self.min_tokens == 0

    @property
    def needs_processing(self) -> bool:
        """Anything beyond temperature / top-k / top-p that changes the logits before sampling."""
        return (
            self.has_penalties
            or bool(self.logit_bias)
            or self.min_tokens > 0
            or self.min_p > 0
            or self.grammar is not None
        )
