"""From an EngineConfig to an engine's parts: the one construction path (`Engine.__init__` wires them).

    parts = build_parts(config)                          # loads the model, sizes the pool, builds the runner
    parts = build_parts(config, model=m, tokenizer=t)    # on a loaded LlamaModel
    parts = build_parts(config, tp_session=s)            # on a running tensor-parallel session (not owned)

Resolved here, in order: CPU threads, the device, tensor parallelism (`tp > 1` without a session
starts one, which the engine owns and closes), the dtype, the model and its tokenizer, the kernel backend,
the weights' format (`quantize`; "auto" by options.pick_quantize), packed weights, CUDA graphs, the pool's
size and the context limit, the KV cache, the host tier, the runner and the drafter. Checks that need
the model or the device raise here (ValueError / RuntimeError); the ones that need neither are EngineConfig's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from minisched.base.cpus import default_num_threads
from minisched.engine.config import EngineConfig
from minisched.engine.cuda_graph import CudaGraphRunner
from minisched.engine.draft import ModelDrafter
from minisched.engine.kv_tier import HostKVMover
from minisched.engine.options import pick_backend, pick_quantize, pool_pages, want_cuda_graph
from minisched.engine.runner import ModelRunner
from minisched.engine.threads import ThreadTuner
from minisched.model import weights
from minisched.model.llama import LlamaModel
from minisched.model.packed import pack_model, want_packed
from minisched.model.quant import QuantConfig, held_mode, quantize_model
from minisched.model.tokenizer import MiniTokenizer, load_tokenizer
from minisched.parallel.launch import TPSession
from minisched.parallel.source import ModelSource
from minisched.sched.config import SchedulerConfig
from minisched.sched.host_tier import HostTier
from minisched.sched.spec import Drafter, NgramDrafter


@dataclass(frozen=True, kw_only=True)
class EngineParts:
    config: EngineConfig  # as resolved: the quantize mode; under --tp the session's model, device and threads
    model: LlamaModel
    model_name: str
    tokenizer: MiniTokenizer
    device: torch.device
    backend: str
    quant: QuantConfig
    pack_weights: bool
    cuda_graph: bool
    num_threads: int
    sched_config: SchedulerConfig  # the pool's size and the context limit filled in
    kv_cache: torch.Tensor
    runner: ModelRunner
    host_tier: Optional[HostTier]
    drafter: Optional[Drafter]
    tp_session: Optional[TPSession]
    owns_tp_session: bool  # started here: the engine closes it


def torch_dtype(config: EngineConfig) -> torch.dtype:
    return getattr(torch, config.resolved_dtype)


def build_parts(
    config: EngineConfig,
    *,
    model: Optional[LlamaModel] = None,
    tokenizer: Optional[MiniTokenizer] = None,
    tp_session: Optional[TPSession] = None,
) -> EngineParts:
    if model is not None and (tp_session is not None or config.tp != 1):
        raise ValueError(
            "a loaded model cannot be split over tensor-parallel ranks (give its name: Engine(name, tp=N))"
        )
    owns = tp_session is None and config.tp != 1
    if owns:
        tp_session = TPSession.start(
            config.tp,
            ModelSource(config.model, dtype=torch_dtype(config)),
            device=config.device,
            timeout=config.tp_timeout,
            num_threads=config.num_threads,
        )
    try:
        return _build(config, model, tokenizer, tp_session, owns)
    except BaseException:
        if owns and tp_session is not None:
            tp_session.close()
        raise


def _build(
    config: EngineConfig,
    model: Optional[LlamaModel],
    tokenizer: Optional[MiniTokenizer],
    session: Optional[TPSession],
    owns: bool,
) -> EngineParts:
    if session is not None:  # the ranks loaded and sharded the model; their threads share the node's cores
        fixed = {"model": session.source.name, "device": str(session.device), "tp": session.world}
        if config.num_threads is None:
            fixed["num_threads"] = session.num_threads
        config = config.with_options(**fixed)
        model, tokenizer = session.model, tokenizer or session.source.tokenizer()
    tp = session is not None
    # CPU threads (process-wide in torch). An int: that many, fixed. None: between 1 and the cores this
    # process may use, chosen while serving by measuring (engine/threads.py). The kernels' thread pool
    # follows the count (csrc/cpu/thread_pool.h); torch's OpenMP wait policy is set in minisched/__init__.py.
    num_threads = config.num_threads or default_num_threads()
    tuner = ThreadTuner(num_threads) if config.num_threads is None and num_threads > 1 else None
    if num_threads != torch.get_num_threads():
        torch.set_num_threads(num_threads)
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but no CUDA device is available")
    if config.quantize not in ("auto", "none") and device.type != "cpu":  # checked before loading
        raise ValueError(f"quantize={config.quantize!r} runs on the CPU")
    loaded = model is None  # from config.model (not a model object, not a tensor-parallel session's)
    if model is not None:
        model_name = config.model or "custom"
        if tokenizer is None:  # a byte-level guess would decode garbage silently
            raise ValueError(
                "Engine(model_object) needs tokenizer=...: a LlamaModel carries no tokenizer "
                "(pass MiniTokenizer.byte_level(vocab_size) explicitly for byte-level tests)"
            )
    else:
        model, model_name = load_model(config, device), config.model or weights.DEFAULT_MODEL
        tokenizer = tokenizer or load_tokenizer(config.model)
    backend = pick_backend(config.backend, device)
    # the projections' format (model/quant.py; "auto" resolved by pick_quantize), converted in place; a model
    # passed in quantized stays as it is. gguf, gguf-a8: the file's block-quantized tensors. The engine's
    # config names the mode it runs, as it does the session's model under tensor parallelism.
    held = held_mode(model)
    quant, blocks = pick_quantize(
        config.quantize, device, model.dtype, backend, tp, config.model, loaded, config.pack_weights, held
    )
    if quant.mode != held:
        quantize_model(model, quant, blocks)
    config = config.with_options(quantize=quant.mode)
    # packed float32 projections (model/packed.py): the CPU default, for the small-batch matmuls (with
    # gguf and gguf-a8: the tensors the file holds as floats)
    converted = quant.enabled and not quant.keeps_gguf_blocks  # int8, bf16: no float32 projection is left
    pack = want_packed(config.pack_weights, device, model.dtype, backend, converted, tp)
    if pack:
        pack_model(model)
    cuda_graph = want_cuda_graph(config.cuda_graph, device, backend, config.check, tp)
    num_pages, max_context_len = size_pool(config, model, device)
    page_size = config.page_size
    sched_config = dataclasses.replace(config.scheduler, num_pages=num_pages, max_context_len=max_context_len)
    # with CUDA graphs one more page, outside the scheduler's pool: the padding rows' scratch page
    kv_cache = model.new_kv_cache(num_pages + cuda_graph, page_size)
    graphs = None
    if cuda_graph:
        graphs = CudaGraphRunner(
            model,
            kv_cache,
            page_size,
            max_batch=sched_config.max_running_requests,
            max_context_len=max_context_len,
            scratch_page=num_pages,
            backend=backend,
        )
        graphs.capture()
    host_tier, mover = None, None  # the host KV tier under the radix cache (engine/kv_tier.py)
    if config.host_kv_pages:
        mover = HostKVMover(kv_cache, backend, config.host_kv_pages)
        host_tier = HostTier(config.host_kv_pages, mover, write_through=config.host_kv_write_through)
    runner = ModelRunner(
        model,
        kv_cache,
        page_size,
        backend=backend,
        cascade=config.cascade,
        check=config.check,
        thread_tuner=tuner if device.type == "cpu" and not tp else None,  # the ranks' counts are fixed
        cuda_graphs=graphs,
        kv_mover=mover,
        tp_session=session,
    )
    drafter: Optional[Drafter] = None  # speculative decoding (sched/spec.py): drafts verified in one forward
    if config.speculative == "ngram":
        drafter = NgramDrafter(config.ngram_min_match, config.ngram_max_match)
    elif config.speculative == "draft":
        draft = draft_model(config, model, model_name, pack)
        drafter = ModelDrafter(draft, num_pages, page_size, backend)
    return EngineParts(
        config=config,
        model=model,
        model_name=model_name,
        tokenizer=tokenizer,
        device=device,
        backend=backend,
        quant=quant,
        pack_weights=pack,
        cuda_graph=cuda_graph,
        num_threads=num_threads,
        sched_config=sched_config,
        kv_cache=kv_cache,
        runner=runner,
        host_tier=host_tier,
        drafter=drafter,
        tp_session=session,
        owns_tp_session=owns,
    )


def load_model(config: EngineConfig, device: torch.device) -> LlamaModel:
    dtype = torch_dtype(config)
    cfg, state = weights.load(config.model, dtype=dtype, device=device, seed=config.seed)
    try:
        return LlamaModel.from_state_dict(cfg, state, dtype=dtype, device=device)
    except (KeyError, RuntimeError, ValueError) as exc:  # missing or misshapen tensors
        raise weights.ModelLoadError(
            f"cannot load the model {config.model or weights.DEFAULT_MODEL}: its "
            f"weights do not fit its config ({type(exc).__name__}: {exc})"
        ) from None


def size_pool(config: EngineConfig, model: LlamaModel, device: torch.device) -> tuple[int, int]:
    """The pool's page count and the context limit."""
    cfg, page_size = model.cfg, config.page_size
    num_pages = pool_pages(cfg, model.dtype.itemsize, device, page_size, config.num_pages, config.mem_fraction)
    max_context_len = config.max_context_len
    if max_context_len is None:
        max_context_len = min(cfg.max_position, num_pages * page_size)
    elif max_context_len > cfg.max_position:
        raise ValueError(
            f"max_context_len must be an int in [2, {cfg.max_position}] (the model's "
            f"position limit), got {max_context_len!r}"
        )
    return num_pages, max_context_len


def draft_model(config: EngineConfig, model: LlamaModel, model_name: str, pack: bool) -> LlamaModel:
    """The draft model: the engine's own when `draft_model` is "self" or names it (a model drafting for
    itself), else loaded as the target is (dtype, device, packed weights); it must share the vocabulary."""
    if config.draft_model in ("self", model_name):
        return model
    cfg, state = weights.load(config.draft_model, dtype=model.dtype, device=model.device, seed=config.seed)
    draft = LlamaModel.from_state_dict(cfg, state, dtype=model.dtype, device=model.device)
    if cfg.vocab_size != model.cfg.vocab_size:
        raise ValueError(
            f"the draft model {config.draft_model} has a vocabulary of {cfg.vocab_size}, the model {model.cfg.vocab_size}"
        )
    if pack:
        pack_model(draft)
    return draft
