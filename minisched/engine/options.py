"""Engine options resolved at construction: the kernel backend, the weights' format (`quantize`), CUDA graphs,
the KV pool's size."""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch

from minisched import ops
from minisched.base.values import cdiv
from minisched.model import weights
from minisched.model.config import ModelConfig
from minisched.model.packed import want_packed
from minisched.model.quant import QuantConfig

CPU_DEFAULT_POOL_TOKENS = 16384


def pick_backend(backend: str, device: torch.device) -> str:
    if backend != "auto":
        if backend not in ops.BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; expected 'auto' or one of {ops.BACKENDS}")
        if backend == "native" and not ops.native_available():
            raise RuntimeError(ops.NATIVE_ERROR)
        if backend == "triton":
            if importlib.util.find_spec("triton") is None:
                raise RuntimeError("backend 'triton' needs the triton package (pip install triton)")
            if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
                raise RuntimeError(
                    f"backend 'triton' compiles for CUDA GPUs, and the device is {device}; use "
                    f"--device cuda, another backend, or TRITON_INTERPRET=1 to run the Triton "
                    f"interpreter on the CPU (very slow)"
                )
        return backend
    if ops.native_available():
        return "native"
    return "triton" if device.type == "cuda" else "torch"


GGUFBlocks = dict[str, tuple[int, torch.Tensor]]  # weights.gguf_blocks: {HF name: (GGML type id, blocks)}


def pick_quantize(
    quantize: str,
    device: torch.device,
    dtype: torch.dtype,
    backend: str,
    tensor_parallel: bool,
    model: Optional[str],
    loaded: bool,
    pack_weights: Optional[bool] = None,
    held: str = "none",
) -> tuple[QuantConfig, Optional[GGUFBlocks]]:
    """The projections' and LM head's format (model/quant.py) and, for gguf and gguf-a8, the GGUF file's blocks
    (weights.gguf_blocks of `model`, the config's model spec; `loaded`: the engine loaded the weights
    from it, rather than being given a model object or a tensor-parallel session's).

    An explicit mode is itself (quantize_model and gguf_blocks raise where it cannot run). "auto", the
    default, is gguf where gguf computes the float32 path's bits (packed_linear's FMA chains on the
    dequantized weights) from ~1/6 of the weight bytes: the engine loaded a float32 model from a GGUF
    file whose projections are block-quantized (Q4_0 / Q4_1 / Q8_0), and it runs where float32 weights
    are packed by default (packed.want_packed: the CPU, float32, the native kernels, no tensor
    parallelism) and `pack_weights` (EngineConfig's; --no-pack-weights is False) did not turn packing off.
    Anything else is none: a model object, dummy or safetensors weights, CUDA, bfloat16, --tp, the torch or
    Triton backend, --no-pack-weights (the plain float32 path, asked for), a GGUF file of float tensors.
    (Measured: faster decode at every batch, a level 512-token prefill; benchmarks/RESULTS.md.)

    Never gguf-a8: its 8-bit activations are not fp32's bits, so it is asked for or not run.

    `held` (quant.held_mode of a model object): weights converted before, by an engine built on the same
    object, stay what they are; auto is that mode, and any other explicit mode is a ValueError (converting
    again would fail or leave the engine naming a mode it does not run).

    Explicit gguf (and gguf-a8, alike here) with --no-pack-weights still runs its blocks: they are their
    own format (gguf_linear, gguf_a8_linear), and pack_weights only decides the tensors the file holds as
    floats, which then stay unpacked. Explicit gguf needs the GGUF file the model came from: with a model
    object (not `loaded`), `model` must name that file, else a ValueError here, at construction (an unnamed
    model object is not assumed to be the bundled SmolLM2, and Engine.fresh's name for it, "custom", is no
    file)."""
    if held != "none":  # a model object converted before (quant.held_mode): it runs as it is, or not at all
        if quantize not in ("auto", held):
            raise ValueError(
                f"quantize={quantize!r}: this model object's weights are --quantize {held}'s already (an engine "
                f"converted them in place); use quantize={held!r} or 'auto', or load the model again"
            )
        return QuantConfig(held), None
    if quantize != "auto":
        cfg = QuantConfig(quantize)
        if not cfg.keeps_gguf_blocks:
            return cfg, None
        if not loaded and not names_gguf_file(model):
            raise ValueError(
                f"--quantize {cfg.mode} needs a model loaded from a GGUF file with block-quantized projections: "
                f"this engine was given a model object (model={model!r}), with no file to read the blocks from; "
                f"load the model by its path (Engine('model.gguf', quantize='{cfg.mode}')), name its file "
                f"(config=EngineConfig(model='model.gguf', quantize='{cfg.mode}')), or use quantize='none'"
            )
        return cfg, weights.gguf_blocks(model)
    none = QuantConfig("none"), None
    if not loaded or not want_packed(pack_weights, device, dtype, backend, False, tensor_parallel):
        return none
    if weights.resolve(model)[0] != "gguf":
        return none
    blocks = weights.gguf_blocks(model)
    if not any(name.startswith("model.layers.") for name in blocks):  # float projections (a head alone: no)
        return none
    return QuantConfig("gguf"), blocks


def names_gguf_file(model: Optional[str]) -> bool:
    """`model`, a config's model spec, is a GGUF file (None names none: with a model object, no file)."""
    if model is None:
        return False
    try:
        return weights.resolve(model)[0] == "gguf"
    except (weights.ModelNotFound, ValueError):  # no model name at all (Engine.fresh's "custom")
        return False


def available_bytes(device: torch.device, meminfo: str = "/proc/meminfo") -> int:
    """Memory a KV pool may take: free device memory on CUDA; on the CPU the kernel's MemAvailable
    (free pages plus the page cache it can drop -- free pages alone were 0.35 of 12 GiB available
    after a few model loads, and a restarted engine refused to start), else the free pages."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 40


def want_cuda_graph(
    cuda_graph: Optional[bool], device: torch.device, backend: str, check: bool, tensor_parallel: bool
) -> bool:
    """Decode by CUDA graph replay (engine/cuda_graph.py). None: on for CUDA with the native or Triton
    kernels, check=False and no tensor parallelism (its forward's collectives are not captured);
    True where that cannot work is an error."""
    if cuda_graph is not None and not isinstance(cuda_graph, bool):
        raise ValueError(f"cuda_graph must be True, False or None (the device's default), got {cuda_graph!r}")
    usable = device.type == "cuda" and backend != "torch" and not check and not tensor_parallel
    if cuda_graph and not usable:
        why = (
            f"the device is {device}"
            if device.type != "cuda"
            else "a tensor-parallel forward is not captured"
            if tensor_parallel
            else "the torch reference backend reads index values on the host"
            if backend == "torch"
            else "check=True reads index values on the host (a sync, which capture forbids)"
        )
        raise ValueError(
            f"cuda_graph=True needs a CUDA device, the native or Triton kernels, check=False "
            f"and no tensor parallelism: {why}"
        )
    return usable if cuda_graph is None else cuda_graph


def pool_pages(
    cfg: ModelConfig,
    itemsize: int,
    device: torch.device,
    page_size: int,
    num_pages: Optional[int],
    mem_fraction: Optional[float],
) -> int:
    """The KV pool's page count: given, a fraction of the free memory, or the device's default
    (the values' types and ranges are EngineConfig's to check)."""
    per_page = cfg.kv_bytes_per_token(itemsize) * page_size
    avail = available_bytes(device)
    if num_pages is None:
        if mem_fraction is not None:
            num_pages = int(avail * mem_fraction) // per_page
        elif device.type == "cuda":
            num_pages = int(avail * 0.85) // per_page
        else:
            num_pages = cdiv(CPU_DEFAULT_POOL_TOKENS, page_size)
    if not isinstance(num_pages, int) or num_pages < 2:
        raise ValueError(
            f"the KV pool needs at least 2 pages, got {num_pages} (page_size={page_size}, {per_page} bytes per page)"
        )
    if num_pages * per_page > avail:
        raise ValueError(
            f"a KV pool of {num_pages} pages x {page_size} tokens needs "
            f"{num_pages * per_page / 2**30:.2f} GiB but only {avail / 2**30:.2f} GiB is free "
            f"on {device}; lower num_pages or mem_fraction"
        )
    return num_pages
