"""`EngineConfig`: every engine option in one frozen, validated object, from the command line down.

    cfg = EngineConfig.from_options(model="smollm2", page_size=16, policy="lpm")   # or EngineConfig(...)
    cfg = cfg.with_options(num_pages=512, enable_radix_cache=False)                  # a copy
    Engine(config=cfg)          # Engine(model, **options) builds the same from keyword options

It holds the scheduler's config (`scheduler`: policy, budgets, page size); options are
split between the two by field name, as nano-vllm filters its keyword arguments, so either
spelling works. The pool's size is the engine's to resolve (`num_pages` or `mem_fraction`,
else the device's default; `max_context_len` else the model's limit or the pool): the engine
hands the scheduler a copy with those filled in (`Engine.sched_config`).

Checks here need no model and no device (ValueError); what depends on them (a backend that
is not installed, CUDA graphs on a CPU, a pool larger than memory) is checked by the Engine
(options.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from minisched.base.values import is_int, is_real
from minisched.sched.config import SchedulerConfig
from minisched.sched.spec import SPECULATIVE

DTYPES = ("float32", "bfloat16", "float16")
BACKEND_CHOICES = ("auto", "native", "triton", "torch")
QUANTIZE_CHOICES = ("none", "int8", "bf16")  # model/quant.py


def default_scheduler() -> SchedulerConfig:
    """The engine's scheduling defaults (smaller batches than the bare scheduler's; the pool is sized later)."""
    return SchedulerConfig(num_pages=None, max_context_len=None, max_prefill_tokens=4096, max_running_requests=64)


@dataclass(frozen=True)
class EngineConfig:
    model: Optional[str] = None  # 'smollm2' (the default), a .gguf, an HF directory, dummy:<preset>
    device: str = "cpu"
    dtype: Optional[str] = None  # None: float32 on the CPU, bfloat16 on CUDA
    backend: str = "auto"  # attention / KV kernels: native, triton, torch (the reference)
    num_pages: Optional[int] = None  # KV pool pages; None: mem_fraction, else the device's default
    mem_fraction: Optional[float] = None
    max_context_len: Optional[int] = None  # None: the model's limit or the pool, whichever is smaller
    cascade: bool = False
    num_threads: Optional[int] = None  # None: tuned while serving (engine/threads.py)
    overlap: Optional[bool] = None  # None: on for CUDA, off for the CPU
    cuda_graph: Optional[bool] = None  # None: on for CUDA with the native or Triton kernels
    quantize: str = "none"
    pack_weights: Optional[bool] = None  # None: on for a float32 CPU model (model/packed.py)
    check: bool = False  # ops read index values and check them (slow; tests)
    seed: int = 0  # dummy weights
    tp: int = 1  # tensor-parallel ranks (cli/common.py starts them)
    tp_timeout: float = 60.0
    host_kv_pages: int = 0  # the host tier under the radix cache, in pages (0: off; engine/kv_tier.py)
    host_kv_write_through: bool = False  # copy new cache nodes to the host at once, not on eviction
    speculative: Optional[str] = None  # speculative decoding's drafter: "ngram" (prompt lookup; sched/spec.py), "draft"
    draft_model: Optional[str] = (
        None  # speculative="draft": a model of the same vocabulary, or "self" (engine/draft.py)
    )
    ngram_min_match: int = 2  # the n-gram drafter's shortest suffix match
    ngram_max_match: int = 4  # ... and longest
    scheduler: SchedulerConfig = field(default_factory=default_scheduler)

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        need(
            self.model is None or (isinstance(self.model, str) and self.model != ""),
            f"model must be a name or a path, got {self.model!r}",
        )
        need(
            isinstance(self.device, str) and self.device.split(":")[0] in ("cpu", "cuda"),
            f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}",
        )
        need(self.dtype is None or self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        need(self.backend in BACKEND_CHOICES, f"unknown backend {self.backend!r}; expected one of {BACKEND_CHOICES}")
        need(self.quantize in QUANTIZE_CHOICES, f"quantize must be one of {QUANTIZE_CHOICES}, got {self.quantize!r}")
        if self.num_pages is not None and self.mem_fraction is not None:
            raise ValueError("give num_pages or mem_fraction, not both")
        need(
            self.num_pages is None or (is_int(self.num_pages) and self.num_pages >= 2),
            f"the KV pool needs at least 2 pages, got num_pages={self.num_pages!r}",
        )
        need(
            self.mem_fraction is None or (is_real(self.mem_fraction) and 0 < self.mem_fraction <= 1),
            f"mem_fraction must be in (0, 1], got {self.mem_fraction!r}",
        )
        need(
            self.max_context_len is None or (is_int(self.max_context_len) and self.max_context_len >= 2),
            f"max_context_len must be an int >= 2, got {self.max_context_len!r}",
        )
        need(
            self.num_threads is None or (is_int(self.num_threads) and self.num_threads >= 1),
            f"num_threads must be an int >= 1 or None, got {self.num_threads!r}",
        )
        for name in ("overlap", "cuda_graph", "pack_weights"):
            v = getattr(self, name)
            need(v is None or isinstance(v, bool), f"{name} must be True, False or None (the default), got {v!r}")
        for name in ("cascade", "check"):
            need(isinstance(getattr(self, name), bool), f"{name} must be a bool, got {getattr(self, name)!r}")
        need(is_int(self.seed), f"seed must be an int, got {self.seed!r}")
        need(is_int(self.tp) and self.tp >= 1, f"tp must be an int >= 1, got {self.tp!r}")
        need(is_real(self.tp_timeout) and self.tp_timeout > 0, f"tp_timeout must be > 0, got {self.tp_timeout!r}")
        need(
            is_int(self.host_kv_pages) and self.host_kv_pages >= 0,
            f"host_kv_pages must be an int >= 0, got {self.host_kv_pages!r}",
        )
        need(isinstance(self.host_kv_write_through, bool), "host_kv_write_through must be a bool")
        if self.host_kv_pages and self.tp != 1:
            raise ValueError("the host KV tier with tensor parallelism is not supported (each rank has its own pool)")
        need(
            self.speculative is None or self.speculative in SPECULATIVE,
            f"speculative must be None or one of {SPECULATIVE}, got {self.speculative!r}",
        )
        need(
            is_int(self.ngram_min_match)
            and is_int(self.ngram_max_match)
            and 1 <= self.ngram_min_match <= self.ngram_max_match,
            f"need 1 <= ngram_min_match <= ngram_max_match, got {self.ngram_min_match!r}, {self.ngram_max_match!r}",
        )
        need(
            (self.speculative == "draft") == (self.draft_model is not None),
            f"speculative='draft' and draft_model go together, got {self.speculative!r} and {self.draft_model!r}",
        )
        if self.speculative == "draft" and self.tp != 1:
            raise ValueError("a draft model with tensor parallelism is not supported (speculative='ngram' is)")
        need(isinstance(self.scheduler, SchedulerConfig), "scheduler must be a SchedulerConfig")
        if self.quantize != "none" and self.tp != 1:
            raise ValueError("quantize with tensor parallelism is not supported (the ranks shard fp32 weights)")

    @property
    def page_size(self) -> int:
        return self.scheduler.page_size

    @classmethod
    def from_options(cls, base: Optional[EngineConfig] = None, **options: Any) -> EngineConfig:
        """`base` (or the defaults) with `options` applied; each option is an EngineConfig or a
        SchedulerConfig field (TypeError for any other name)."""
        return (base or cls()).with_options(**options)

    def with_options(self, **options: Any) -> EngineConfig:
        """A copy with these EngineConfig / SchedulerConfig fields replaced."""
        mine = {f.name for f in dataclasses.fields(self)} - {"scheduler"}
        theirs = {f.name for f in dataclasses.fields(SchedulerConfig)} - {"num_pages", "max_context_len"}
        unknown = sorted(set(options) - mine - theirs)
        if unknown:
            raise TypeError(
                f"unknown engine option(s) {', '.join(unknown)}; expected EngineConfig fields "
                f"{sorted(mine)} or scheduler fields {sorted(theirs)}"
            )
        if "dtype" in options and options["dtype"] is not None and not isinstance(options["dtype"], str):
            options["dtype"] = str(options["dtype"]).removeprefix("torch.")  # torch.bfloat16 -> "bfloat16"
        sched = {k: options.pop(k) for k in list(options) if k in theirs}
        if sched:
            options["scheduler"] = dataclasses.replace(self.scheduler, **sched)
        return dataclasses.replace(self, **options)
