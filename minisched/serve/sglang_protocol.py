"""SGLang's native /generate body as pydantic models (SGLang's `GenerateReqInput` and the
`sampling_params` it documents, docs/basic_usage/sampling_params.md in sgl-project/sglang).

Known fields are strict and range checked, as on the OpenAI routes; unknown ones are accepted and
ignored (sglang-router re-sends the body with fields of its own: `"model": null`, `log_metrics`,
`return_hidden_states`, `background`, `no_logs`, ...). A per-prompt field may be one value or a
list, one per prompt (`rid`, `sampling_params`, `return_logprob`, `logprob_start_len`,
`top_logprobs_num`), as SGLang's.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from minisched.sched.sampling_params import MAX_LOGPROBS
from minisched.serve.protocol import MAX_N, MAX_STOP, APIError

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's SamplingParams default


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class SGLangSampling(_Lenient):
    max_new_tokens: Optional[int] = Field(default=None, ge=0)  # 0: prefill only (prompt logprobs)
    temperature: Optional[float] = Field(default=None, ge=0, le=100, allow_inf_nan=False)
    top_p: Optional[float] = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    top_k: Optional[int] = Field(default=None, ge=-1)
    min_p: float = Field(default=0.0, ge=0, le=1, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2, allow_inf_nan=False)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2, allow_inf_nan=False)
    repetition_penalty: float = Field(default=1.0, gt=0, le=10, allow_inf_nan=False)
    min_new_tokens: int = Field(default=0, ge=0)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # accepted: byte-level BPE adds no spaces anyway
    no_stop_trim: bool = False  # keep the stop string in the text
    json_schema: Optional[Union[str, dict[str, Any]]] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    logit_bias: Optional[dict[str, float]] = None
    sampling_seed: Optional[int] = Field(default=None, ge=0, lt=2**64)

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
            raise ValueError("top_k must be -1 (disable), or at least 1")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_ids(cls, v):
        if any(t < 0 for t in v or ()):
            raise ValueError("stop_token_ids must be >= 0")
        return v

    def grammar(self) -> Optional[tuple[str, str]]:
        asked = []
        if self.json_schema is not None:
            spec = self.json_schema if isinstance(self.json_schema, str) else json.dumps(self.json_schema)
            asked.append(("json_schema", spec))
        if self.regex is not None:
            asked.append(("regex", self.regex))
        if self.ebnf is not None:
            asked.append(("ebnf", self.ebnf))
        if len(asked) > 1:
            raise APIError(400, "Only one of regex, json_schema, or ebnf can be set.")
        return asked[0] if asked else None


class GenerateRequest(_Lenient):
    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[Union[SGLangSampling, list[SGLangSampling]]] = None
    rid: Optional[Union[str, list[str]]] = None
    return_logprob: Union[bool, list[bool]] = False
    logprob_start_len: Union[int, list[int]] = -1  # -1: output tokens only
    top_logprobs_num: Union[int, list[int]] = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    priority: int = Field(default=0, ge=-(2**31), lt=2**31)
    model: Optional[str] = None  # the router sends null; /generate serves this server's model whatever it says

    def batch(self) -> tuple[bool, list[Union[str, list[int]]]]:
        """(is a batch, the prompts): text or token ids, one of them."""
        if (self.text is None) == (self.input_ids is None):
            raise APIError(400, "Either text or input_ids should be provided (one of them).")
        prompts: list[Union[str, list[int]]]
        if self.text is not None:
            prompts = [self.text] if isinstance(self.text, str) else list(self.text)
            is_batch = not isinstance(self.text, str)
        else:
            ids = self.input_ids or []  # not None: exactly one of text and input_ids is set
            # pydantic gave one shape: list[list[int]] (a batch) when its first entry is a list, else list[int]
            rows = [x for x in ids if isinstance(x, list)]
            is_batch = bool(rows)
            prompts = list(rows) if is_batch else [[x for x in ids if isinstance(x, int)]]
        if not prompts:
            raise APIError(400, "The batch of prompts is empty.")
        return is_batch, prompts

    def per_prompt(self, name: str, count: int, default):
        """Field `name` for each of `count` prompts (a list must have one entry per prompt)."""
        v = getattr(self, name)
        if v is None:
            return [default] * count
        if isinstance(v, list):
            if len(v) != count:
                raise APIError(400, f"{name} has {len(v)} entries for {count} prompts")
            return list(v)
        return [v] * count

    def check_logprob_fields(self) -> None:
        def listed(v) -> list:
            return v if isinstance(v, list) else [v]

        if any(not 0 <= k <= MAX_LOGPROBS for k in listed(self.top_logprobs_num)):
            raise APIError(400, f"top_logprobs_num must be in [0, {MAX_LOGPROBS}]")
        if any(s < -1 for s in listed(self.logprob_start_len)):
            raise APIError(400, "logprob_start_len must be -1 (output tokens only) or >= 0")


class SGLangErrorInfo(BaseModel):
    message: str


class SGLangError(BaseModel):
    """SGLang's error body (`{"error": {"message": ...}}`), declared on its routes for the OpenAPI schema."""

    error: SGLangErrorInfo
