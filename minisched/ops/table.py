"""The op table: one `OpSpec` per op, the one place that says where an op's faces live.

An op `name` of family `family` has: its schema in csrc/torch_bindings.cpp, a CPU kernel in
csrc/cpu/<family>.cpp, a CUDA kernel in csrc/cuda/<family>.cu (if `cuda`), a Triton kernel
`name` in triton_kernels/<family>.py (if `triton`; the module minisched.triton_kernels.<family>),
the reference `reference.<name>`, the input checks `checks.<name>` (with a `values=` switch if
`reads_indices`), its fake `fakes.<name>`, and its tests in tests/ops/test_<family>.py. docs/architecture.md ("Adding an op") lists the steps.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OpSpec:
    name: str
    family: str  # the file stem shared by its C++, CUDA, Triton and test files
    reads_indices: bool = True  # its checks read index values (skipped with check=False)
    triton: bool = True  # has a Triton kernel
    cuda: bool = True  # has a CUDA kernel (the CPU-only ops serve the CPU's own bottlenecks)


OPS: dict[str, OpSpec] = {
    s.name: s
    for s in (
        OpSpec("store_kv", "store_kv"),
        OpSpec("copy_kv_pages", "kv_pages"),
        OpSpec("gather_kv_pages", "kv_pages"),
        OpSpec("scatter_kv_pages", "kv_pages"),
        OpSpec("paged_decode_attention", "paged_decode_attention"),
        OpSpec("paged_prefill_attention", "paged_prefill_attention"),
        OpSpec("shared_prefix_attention", "shared_prefix_attention"),
        OpSpec("merge_attention_states", "merge_attention_states", reads_indices=False),
        # CPU only: weight-only int8 for bandwidth-bound decode, the packed float32 matmul for small-batch
        # projections, the fused RMSNorm for per-op overhead (GPUs have cuBLAS and torch's fused norm).
        OpSpec("int8_linear", "int8_linear", reads_indices=False, triton=False, cuda=False),
        OpSpec("packed_linear", "packed_linear", reads_indices=False, triton=False, cuda=False),
        # CPU only: a GGUF file's own 4/8-bit blocks, dequantized in registers (the fp32 model from ~1/6 the bytes).
        OpSpec("gguf_linear", "gguf_linear", reads_indices=False, triton=False, cuda=False),
        # CPU only: the same blocks against activations rounded to 8 bits per block of 32 (llama.cpp's
        # trade: integer dot products, not float32's bits), for single-stream decode.
        OpSpec("gguf_a8_linear", "gguf_a8_linear", reads_indices=False, triton=False, cuda=False),
        OpSpec("rms_norm", "rms_norm", reads_indices=False, triton=False, cuda=False),
        # CPU only: the elementwise tail of a layer in one pass each (SwiGLU's silu * up; RoPE writing the
        # contiguous q and k the attention takes), where torch runs 2-6 kernels and temporaries.
        OpSpec("silu_and_mul", "silu_and_mul", reads_indices=False, triton=False, cuda=False),
        OpSpec("rope", "rope", reads_indices=False, triton=False, cuda=False),
    )
}
