"""SGLang's native /generate body as pydantic models (SGLang's `GenerateReqInput` and the
`sampling_params` it documents, docs/basic_usage/sampling_params.md in sgl-project/sglang).

Known fields are strict and range checked with the OpenAI routes' bounds (the sampling fields both
share are protocol.py's `SamplingFields`); unknown ones are accepted and ignored (sglang-router re-sends the body with fields of its own: `"model": null`, `log_metrics`,
`return_hidden_states`, `background`, `no_logs`, ...). A per-prompt field may be one value or a
list, one per prompt (`rid`, `sampling_params`, `return_logprob`, `logprob_start_len`,
`top_logprobs_num`), as SGLang's.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Optional, Union

from pydantic import BaseModel, Field

from minisched.sched.sampling_params import MAX_LOGPROBS, Grammar
from minisched.serve.protocol import APIError, Lenient, SamplingFields


class SGLangSampling(SamplingFields):
    """SGLang's `sampling_params`: the shared fields (protocol.py's SamplingFields, their bounds) and SGLang's
    names for the rest."""

    max_new_tokens: Optional[int] = Field(default=None, ge=0)  # 0: prefill only (prompt logprobs)
    min_new_tokens: int = Field(default=0, ge=0)
    spaces_between_special_tokens: bool = True  # accepted: byte-level BPE adds no spaces anyway
    no_stop_trim: bool = False  # keep the stop string in the text
    json_schema: Optional[Union[str, dict[str, Any]]] = None
    sampling_seed: Optional[int] = Field(default=None, ge=0, lt=2**64)

    ONE_GRAMMAR: ClassVar[str] = "Only one of regex, json_schema, or ebnf can be set."

    def _schema_grammars(self) -> list[Grammar]:
        if self.json_schema is None:
            return []
        spec = self.json_schema if isinstance(self.json_schema, str) else json.dumps(self.json_schema)
        if not spec:
            raise APIError(400, "json_schema: an empty schema", param="json_schema", code="invalid_grammar")
        return [Grammar("json_schema", spec)]

    def to_sampling(
        self, *, priority: int, logprobs: Optional[int], prompt_logprobs: Optional[int], start: int
    ) -> dict[str, Any]:
        return dict(
            self.shared_sampling(),
            seed=self.sampling_seed,
            min_tokens=self.min_new_tokens,
            priority=priority,
            include_stop_str_in_output=self.no_stop_trim,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            prompt_logprob_start=start,
        )


class GenerateRequest(Lenient):
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
