"""`SchedulerConfig`: the scheduler's knobs, frozen and validated (ValueError).

Token budgets are per prefill batch. The ratio fields are SGLang's `new_token_ratio`
schedule; `aging_rounds`: see policy.py. The rest, with the reason for each default:

- `max_prefill_rounds_between_decodes` (None: prefill first whenever a prefill batch forms, SGLang's
  and the founding design's rule). k: at most k prefill-only rounds while requests wait to decode;
  1 keeps the gap between a running request's tokens at 2 steps (with a steady stream of arrivals,
  prefill first leaves running requests waiting until the running-request cap stops admissions).
  Measured (benchmarks/sched/bench_rules.py): 1 cuts ITL p99 up to 3x but raises TTFT p99 up to 11 %,
  more material losses than wins, so the default is None. `enable_mixed_chunk` bounds the gap at
  one step instead, where the engine supports mixed batches.
- `clip_max_new_tokens_estimation` (4096, SGLang's CLIP_MAX_NEW_TOKENS): the most future
  tokens one request reserves for admission, so a client's "no limit" cannot block it.
- `retract_decode_steps` (20, SGLang's retract_decode_steps): after a retraction
  `new_token_ratio` is re-estimated from what the requests that stay have decoded:
  min(1, (decoded + steps * batch) / sum(max_new_tokens)).
- `in_batch_prefix_defer_tokens` (32, SGLang's IN_BATCH_PREFIX_CACHING_*_THRESHOLD): a
  waiting request that shares at least this many uncached tokens with a request already in
  the batch waits one round and then hits the cache instead of computing them again.
  None: off.
- `priority_scheduling` (False; vLLM's `--scheduling-policy priority`, SGLang's
  `--enable-priority-scheduling`): waiting requests are offered by `SamplingParams.priority`
  (lower first, vLLM's convention), then by the policy; a request that cannot be admitted
  preempts running requests whose priority is worse by more than
  `priority_preemption_threshold` (0: any strictly less urgent one; None: never preempt);
  `priority_aging_steps` (256): a request's effective priority improves by one every this
  many steps since its arrival, so none starves (None: no aging). sched/preemption.py.
- Speculative decoding (with a drafter, sched/spec.py): `num_draft_tokens` (4) drafts per request
  at most, adapted per request when `spec_adaptive`; no drafting with more than
  `spec_max_batch_size` (8) running requests; with `spec_cost_model` (True) a step keeps only the
  drafts a step-cost model fitted on the machine's own steps expects to pay for (sched/spec_cost.py):
  measured on SmolLM2 (CPU) it keeps free chat at or above plain decoding where verifying every draft
  lost (B=8: 1.02-1.06x against 0.93-0.99x) and input-grounded text where drafts pay (B=1 1.83-1.88x,
  B=8 1.32-1.34x; benchmarks/RESULTS.md, "Speculative decoding"); `--no-spec-cost-model` verifies
  every draft, as SGLang does (not a rule of the "sglang" preset, which holds the scheduler's decisions).
- Presets (`SchedulerConfig.preset(name)`, `PRESETS`, `--sched-profile`): "default" is the above;
  "sglang" makes every decision SGLang 0.5.23's code makes, as benchmarks/sched/diff_sglang.py
  measures it (0 differing steps on 4,000 traces): it sets every rule option below to SGLang's value,
  and no aging (docs/architecture.md, "Scheduler decisions beyond SGLang's").
- The rule options (each field's help says both rules). Each default is the rule that won when the
  option alone was switched against the default profile (benchmarks/sched/bench_rules.py;
  benchmarks/RESULTS.md, "Scheduler" > "Rules: minisched's vs SGLang's", has the numbers):
  minisched's for `admission_budget` (stalls, TTFT p99 and throughput with many waiting),
  `chunk_rule` (stalls when chunk_size < page_size), `in_batch_prefix_rule` ("defer"),
  `retraction_rule` and `pause_admission_when_full` (False) (recomputed tokens), `policy_sort` and
  `aging_rounds` (32) (TTFT p99 / max of cache-cold requests), `conservative_eviction` (False)
  (recomputed tokens, TTFT p99, throughput); SGLang's for `max_prefill_rounds_between_decodes`,
  `max_prefill_tokens_with_chunking` (False), `dfs_weight_fallback` (False), `dfs_ties_reversed`
  (False) and `lru_rule` ("sglang"), where minisched's did not win; the founding design's for
  `retracted_to_tail` (False: retracted requests go to the head of the waiting queue).
- `max_stalled_steps` (32): after this many consecutive steps with work but no batch
  (nothing running, nothing admissible: a bug or leaked pages), the stuck requests end with
  FinishReason.ERROR so callers never spin.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from minisched.base.flags import flag
from minisched.base.values import is_int
from minisched.sched.policy import POLICIES

ADMISSION_BUDGETS = ("minisched", "sglang")
CHUNK_RULES = ("minisched", "sglang")
IN_BATCH_PREFIX_RULES = ("defer", "sglang")
RETRACTION_RULES = ("minisched", "sglang")
POLICY_SORTS = ("minisched", "sglang")
LRU_RULES = ("minisched", "sglang")


@dataclass(frozen=True)
class SchedulerConfig:
    page_size: int = flag(16, "tokens per KV page")
    num_pages: int | None = 4096
    max_context_len: int | None = 4096
    chunk_size: int | None = flag(512, "chunked-prefill tokens per step (0: no chunking)", none_as=0)
    max_prefill_tokens: int = flag(4096, "prompt tokens one prefill batch may compute at most")
    max_running_requests: int = flag(64, "decode batch size limit")
    policy: str = flag(
        "fcfs",
        "waiting-queue order: first come, longest cached prefix, radix-tree DFS weight, longest output first",
        choices=POLICIES,
    )
    enable_radix_cache: bool = flag(
        True, "disable prefix reuse through the radix cache", name="--no-radix-cache", negate=True
    )
    enable_mixed_chunk: bool = flag(False, "let decode tokens ride along with prefill chunks", name="--mixed-chunk")
    max_prefill_rounds_between_decodes: int | None = flag(
        None,
        "at most this many prefill-only rounds while requests wait to decode (0: prefill first, the default, as "
        "SGLang and the founding design; 1: alternate, bounding a running request's gap at 2 steps)",
        none_as=0,
    )
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.098
    new_token_ratio_decay_steps: int = 600
    clip_max_new_tokens_estimation: int = 4096
    retract_decode_steps: int = 20
    in_batch_prefix_defer_tokens: int | None = 32
    lpm_fallback_len: int = 128
    aging_rounds: int | None = flag(
        32,
        "cache-aware policies: a request overtaken this many rounds goes first (0: no aging, as SGLang)",
        none_as=0,
    )
    admission_budget: str = flag(
        "minisched",
        "prefill admission budget: minisched's, or SGLang's (admitted requests reserve their max_new_tokens in full, "
        "the whole remaining prompt plus a page per request is checked with <, pages allocated after selection)",
        choices=ADMISSION_BUDGETS,
    )
    max_prefill_tokens_with_chunking: bool = flag(
        False,
        "check max_prefill_tokens per request also when chunking is on (minisched's rule; SGLang's, the default: "
        "only without chunking, the chunk budget decides)",
    )
    chunk_rule: str = flag(
        "minisched",
        "chunked prefill: minisched's, or SGLang's (a new chunk floored to a page, refused if empty; the carried "
        "request always makes progress and other requests are still offered beside it)",
        choices=CHUNK_RULES,
    )
    in_batch_prefix_rule: str = flag(
        "defer",
        "requests sharing an uncached prefix with one being admitted: deferred one round (any policy), or, as "
        "SGLang, sorted to the end of an LPM queue when their cached prefix is <= the threshold",
        choices=IN_BATCH_PREFIX_RULES,
    )
    retraction_rule: str = flag(
        "minisched",
        "retraction: minisched's (full pages cached, only the next step made room for), or SGLang's (at least one "
        "victim, KV freed without caching, retract_decode_steps tokens evicted per remaining request)",
        choices=RETRACTION_RULES,
    )
    retracted_to_tail: bool = flag(
        False, "retracted requests go to the end of the waiting queue (SGLang) instead of its head"
    )
    pause_admission_when_full: bool = flag(
        False,
        "after the KV budget or the request slots ran out, admit nothing until a running request leaves (SGLang's batch_is_full)",
    )
    policy_sort: str = flag(
        "minisched",
        "waiting-queue sort: minisched's (a fresh order each round), or SGLang's (the sort is kept in the queue, so "
        "ties keep the last order; cache-aware policies match whole sequences; no aging)",
        choices=POLICY_SORTS,
    )
    dfs_weight_fallback: bool = flag(
        False,
        "dfs-weight also falls back to FCFS above lpm_fallback_len waiting requests (minisched's rule; SGLang's, "
        "the default: only lpm does)",
    )
    dfs_ties_reversed: bool = flag(
        False,
        "dfs-weight: equally heavy subtrees newest first (minisched's rule; SGLang's, the default: insertion order)",
    )
    lru_rule: str = flag(
        "sglang",
        "radix-cache LRU: as SGLang (the default), a split node's tail counts as used too and a cached sequence "
        "is split at its prompt; or minisched's (the tail keeps its time, a sequence is one node)",
        choices=LRU_RULES,
    )
    conservative_eviction: bool = flag(
        False, "evict as SGLang's allocator does: for every decode row (and, paged, every extend row) a whole new page"
    )
    max_stalled_steps: int = 32
    priority_scheduling: bool = flag(
        False,
        "order waiting requests by their priority (lower = more urgent, as vLLM; a JSONL or request body "
        "field), preempting less urgent running ones",
    )
    priority_preemption_threshold: int | None = flag(
        0,
        "a request preempts running ones whose priority is worse by more than this (-1: never preempt)",
        none_as=-1,
    )
    priority_aging_steps: int | None = flag(
        256,
        "a waiting or running request's priority improves by one every this many steps (0: no aging)",
        none_as=0,
    )
    num_draft_tokens: int = flag(4, "speculative: draft tokens per request at most")
    spec_max_batch_size: int = flag(
        8, "speculative: no drafting while more requests than this run (large batches are compute-bound)"
    )
    spec_adaptive: bool = flag(
        True, "speculative: adapt each request's draft length to what it accepts, pausing it when nothing is"
    )
    spec_cost_model: bool = flag(
        True,
        "speculative: verify only the draft tokens a step-cost model fitted on this machine's steps expects to "
        "pay for (--no-spec-cost-model: every draft, as SGLang)",
    )

    @classmethod
    def preset(cls, name: str, **fields: Any) -> SchedulerConfig:
        """A named profile (PRESETS) with `fields` on top; ValueError for an unknown name."""
        if name not in PRESETS:
            raise ValueError(f"SchedulerConfig: unknown preset {name!r}; choose one of {tuple(PRESETS)}")
        return replace(cls(**PRESETS[name]), **fields)

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"SchedulerConfig: {msg}")

        for name in (
            "page_size",
            "max_prefill_tokens",
            "max_running_requests",
            "new_token_ratio_decay_steps",
            "clip_max_new_tokens_estimation",
            "retract_decode_steps",
            "lpm_fallback_len",
            "max_stalled_steps",
            "num_draft_tokens",
            "spec_max_batch_size",
        ):
            need(is_int(getattr(self, name)) and getattr(self, name) >= 1, f"{name} must be an int >= 1")
        # None: sized by the engine from the device and the model (engine/config.py); a Scheduler needs both
        need(
            self.num_pages is None or (is_int(self.num_pages) and self.num_pages >= 1), "num_pages must be an int >= 1"
        )
        need(
            self.max_context_len is None or (is_int(self.max_context_len) and self.max_context_len >= 2),
            "max_context_len must be >= 2",
        )
        for name in (
            "chunk_size",
            "max_prefill_rounds_between_decodes",
            "in_batch_prefix_defer_tokens",
            "aging_rounds",
        ):
            v = getattr(self, name)
            need(v is None or (is_int(v) and v >= 1), f"{name} must be None or an int >= 1")
        need(isinstance(self.priority_scheduling, bool), "priority_scheduling must be a bool")
        need(isinstance(self.spec_adaptive, bool), "spec_adaptive must be a bool")
        need(isinstance(self.spec_cost_model, bool), "spec_cost_model must be a bool")
        v = self.priority_preemption_threshold
        need(v is None or (is_int(v) and v >= 0), "priority_preemption_threshold must be None or an int >= 0")
        v = self.priority_aging_steps
        need(v is None or (is_int(v) and v >= 1), "priority_aging_steps must be None or an int >= 1")
        need(self.policy in POLICIES, f"policy must be one of {POLICIES}, got {self.policy!r}")
        for name, allowed in (
            ("admission_budget", ADMISSION_BUDGETS),
            ("chunk_rule", CHUNK_RULES),
            ("in_batch_prefix_rule", IN_BATCH_PREFIX_RULES),
            ("retraction_rule", RETRACTION_RULES),
            ("policy_sort", POLICY_SORTS),
            ("lru_rule", LRU_RULES),
        ):
            need(getattr(self, name) in allowed, f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in (
            "max_prefill_tokens_with_chunking",
            "retracted_to_tail",
            "pause_admission_when_full",
            "dfs_weight_fallback",
            "dfs_ties_reversed",
            "conservative_eviction",
        ):
            need(isinstance(getattr(self, name), bool), f"{name} must be a bool")
        need(
            0 <= self.min_new_token_ratio <= self.init_new_token_ratio <= 1,
            "need 0 <= min_new_token_ratio <= init_new_token_ratio <= 1",
        )


# Named profiles (field -> value over the defaults). "sglang": SGLang 0.5.23's code where a switch exists.
PRESETS: dict[str, dict] = {
    "default": {},
    "sglang": {
        "max_prefill_rounds_between_decodes": None,  # prefill first whenever a prefill batch forms
        "aging_rounds": None,
        "admission_budget": "sglang",
        "max_prefill_tokens_with_chunking": False,
        "chunk_rule": "sglang",
        "in_batch_prefix_rule": "sglang",
        "retraction_rule": "sglang",
        "retracted_to_tail": True,
        "pause_admission_when_full": True,
        "policy_sort": "sglang",
        "dfs_weight_fallback": False,
        "dfs_ties_reversed": False,
        "conservative_eviction": True,
        "lru_rule": "sglang",
    },
}
