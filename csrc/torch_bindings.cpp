// Every minisched op schema, in one place. Each device registers its kernels from its
// own files (csrc/cpu/*.cpp: CPU, csrc/cuda/*.cu: CUDA). Outputs are preallocated by
// the Python wrappers in minisched/ops/__init__.py and marked as mutated (Tensor(a!)).
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(minisched, m) {
  // KV cache movement. One layer's k_cache/v_cache: [num_pages, page_size, Hkv, D];
  // the pool kv_cache: [L, 2, num_pages, page_size, Hkv, D]. Indices are int32.
  m.def("store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("copy_kv_pages(Tensor(a!) kv_cache, Tensor src_pages, Tensor dst_pages) -> ()");
  m.def("gather_kv_pages(Tensor kv_cache, Tensor pages, Tensor(a!) out) -> ()");
  m.def("scatter_kv_pages(Tensor src, Tensor(a!) kv_cache, Tensor pages) -> ()");
  // Attention over the paged cache (FlashInfer CSR page table). LSE: float32, natural log.
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor kv_indptr, "
      "Tensor kv_indices, Tensor kv_last_page_len, float sm_scale, Tensor(a!) out, Tensor(b!)? lse) -> ()");
  m.def(
      "paged_prefill_attention(Tensor q, Tensor qo_indptr, Tensor k_cache, Tensor v_cache, "
      "Tensor kv_indptr, Tensor kv_indices, Tensor kv_last_page_len, bool causal, float sm_scale, "
      "Tensor(a!) out, Tensor(b!)? lse, int kernel=0) -> ()");
  // kernel (CUDA only, ignored elsewhere): 0 auto, 1 the mma.sync kernel, 2 the Hopper wgmma kernel
  // (sm_90, bf16/fp16, head_dim 64/128; one KV split). See minisched.ops.paged_prefill_attention.
  m.def(
      "shared_prefix_attention(Tensor q, Tensor group_indptr, Tensor k_cache, Tensor v_cache, "
      "Tensor prefix_kv_indptr, Tensor prefix_kv_indices, Tensor prefix_kv_last_page_len, float sm_scale, "
      "Tensor(a!) out, Tensor(b!) lse) -> ()");
  m.def(
      "merge_attention_states(Tensor v_a, Tensor lse_a, Tensor v_b, Tensor lse_b, "
      "Tensor(a!) v_out, Tensor(b!) lse_out) -> ()");
  // Weight-only int8 matmul (CPU): out [M, N] = x [M, K] @ (w_q [N, K] int8 * group scales [N, K/G]).T
  m.def("int8_linear(Tensor x, Tensor w_q, Tensor scales, Tensor(a!) out) -> ()");
  // Packed float32 matmul (CPU): out [M, N] = x [M, K] @ w.T, w packed as [ceil(N/16), K, 16] panels
  m.def("packed_linear(Tensor x, Tensor w_packed, Tensor(a!) out) -> ()");
  // RMSNorm (CPU, float32): with delta, x += delta first (the residual add); out = x / rms(x) * weight
  m.def("rms_norm(Tensor(a!) x, Tensor? delta, Tensor weight, float eps, Tensor(b!) out) -> ()");
}

// `import minisched._C` loads this library (and so the registrations above); it has no
// Python functions of its own.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
