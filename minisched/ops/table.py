"""The op table: one `OpSpec` per op, the one place that says where an op's faces live.

An op `name` of family `family` has: its schema in csrc/torch_bindings.cpp, a CPU kernel in
csrc/cpu/<family>.cpp, a CUDA kernel in csrc/cuda/<family>.cu (if `cuda`), a Triton kernel
`name` in triton_kernels/<family>.py (if `triton`; the module minisched.triton_kernels.<family>),
the reference `reference.<name>`, the input checks `checks.<name>` (with a `values=` switch if
`reads_indices`), its sample inputs `samples` (ops/samples.py) and its tests in
tests/ops/test_<family>.py. The schema's argument list is the one signature: the checks, the
reference and the Triton launcher take it as it is (tests/ops/test_op_table.py), and the fake is
the checks themselves (ops/fakes.py registers `input_checks(values=False)` for every entry).
docs/architecture.md ("Adding an op") lists the steps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from minisched.ops import checks, samples
from minisched.ops.samples import Sampler

# The floating dtypes the native kernels take: the paged-KV ops every float (checks.h), the CPU-only ops float32.
ANY_FLOAT = (torch.float32, torch.bfloat16, torch.float16)
FLOAT32 = (torch.float32,)


@dataclass(frozen=True)
class OpSpec:
    name: str
    family: str  # the file stem shared by its C++, CUDA, Triton and test files
    samples: Sampler  # (device, dtype, generator) -> the op's argument lists, for opcheck
    reads_indices: bool = True  # its checks read index values (skipped with check=False)
    triton: bool = True  # has a Triton kernel
    cuda: bool = True  # has a CUDA kernel (the CPU-only ops serve the CPU's own bottlenecks)
    dtypes: tuple[torch.dtype, ...] = ANY_FLOAT  # the samples' dtypes: those its native kernels take

    def input_checks(self, values: bool = True) -> Callable[..., None]:
        """checks.<name>, taking the op's own argument list; with values=False, without the checks that
        read index values (what a FakeTensor cannot give; an op whose checks read none runs them all)."""
        check = getattr(checks, self.name)
        return functools.partial(check, values=values) if self.reads_indices else check


def _cpu_only(name: str, sampler: Sampler) -> OpSpec:
    """A CPU-only op: its own family, no Triton or CUDA kernel, float32, checks that read no index values."""
    return OpSpec(name, name, sampler, reads_indices=False, triton=False, cuda=False, dtypes=FLOAT32)


OPS: dict[str, OpSpec] = {
    s.name: s
    for s in (
        OpSpec("store_kv", "store_kv", samples.store_kv),
        OpSpec("copy_kv_pages", "kv_pages", samples.copy_kv_pages),
        OpSpec("gather_kv_pages", "kv_pages", samples.gather_kv_pages),
        OpSpec("scatter_kv_pages", "kv_pages", samples.scatter_kv_pages),
        OpSpec("paged_decode_attention", "paged_decode_attention", samples.paged_decode_attention),
        OpSpec("paged_prefill_attention", "paged_prefill_attention", samples.paged_prefill_attention),
        OpSpec("shared_prefix_attention", "shared_prefix_attention", samples.shared_prefix_attention),
        OpSpec("merge_attention_states", "merge_attention_states", samples.merge_attention_states, reads_indices=False),
        # CPU only: weight-only int8 for bandwidth-bound decode, the packed float32 matmul for small-batch
        # projections, the fused RMSNorm for per-op overhead (GPUs have cuBLAS and torch's fused norm).
        _cpu_only("int8_linear", samples.int8_linear),
        _cpu_only("packed_linear", samples.packed_linear),
        # CPU only: a GGUF file's own 4/8-bit blocks, dequantized in registers (the fp32 model from ~1/6 the bytes).
        _cpu_only("gguf_linear", samples.gguf_linear),
        # CPU only: the same blocks against activations rounded to 8 bits per block of 32 (llama.cpp's
        # trade: integer dot products, not float32's bits), for single-stream decode.
        _cpu_only("gguf_a8_linear", samples.gguf_a8_linear),
        _cpu_only("rms_norm", samples.rms_norm),
        # CPU only: the elementwise tail of a layer in one pass each (SwiGLU's silu * up; RoPE writing the
        # contiguous q and k the attention takes), where torch runs 2-6 kernels and temporaries.
        _cpu_only("silu_and_mul", samples.silu_and_mul),
        _cpu_only("rope", samples.rope),
    )
}
