// Every minisched op schema, in one place. Each device registers its kernels from its
// own files (csrc/cpu/*.cpp: CPU, csrc/cuda/*.cu: CUDA). Outputs are preallocated by
// the Python wrappers in minisched/ops/__init__.py and marked as mutated (Tensor(a!)).
#include <Python.h>
#include <torch/library.h>

#include <cstring>
#include <utility>

#include "cpu/cpu_isa.h"
#include "cpu/thread_pool.h"

TORCH_LIBRARY(minisched, m) {
  // The fakes (FakeTensor/meta kernels: torch.compile, opcheck) are registered in Python, one per op;
  // torch checks that they come from this module and, where one is missing, names it in its error.
  m.set_python_module("minisched.ops.fakes");
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
  // int8 matmul (CPU): out [M, N] = x [M, K] @ W.T, W = int8 values * group scales in 16-column panels
  // (ops.pack_int8_weight: w_packed [ceil(N/16), K/2, 32], s_packed [ceil(N/16), K/G, 16]); x quantized per row to int16
  m.def("int8_linear(Tensor x, Tensor w_packed, Tensor s_packed, Tensor(a!) out) -> ()");
  // Packed float32 matmul (CPU): out [M, N] = x [M, K] @ w.T, w packed as [ceil(N/16), K, 16] panels
  m.def("packed_linear(Tensor x, Tensor w_packed, Tensor(a!) out) -> ()");
  // GGUF block matmul (CPU): out [M, N] = x [M, K] @ W.T, W in a GGUF block format (qtype: GGML's type id,
  // 2 Q4_0, 3 Q4_1, 8 Q8_0) repacked in 16-row panels (ops.pack_gguf_weight: [ceil(N/16), K/32, 16 x block bytes])
  m.def("gguf_linear(Tensor x, Tensor w_packed, int qtype, Tensor(a!) out) -> ()");
  // The same blocks against x rounded to 8 bits per block of 32 channels (ops.pack_gguf_a8_weight: int32
  // [ceil(N/16), K/32, 4 x block bytes]); integer dot products, close to gguf_linear's result, not its bits
  m.def("gguf_a8_linear(Tensor x, Tensor w_packed, int qtype, Tensor(a!) out) -> ()");
  // RMSNorm (CPU, float32): with delta, x += delta first (the residual add); out = x / rms(x) * weight
  m.def("rms_norm(Tensor(a!) x, Tensor? delta, Tensor weight, float eps, Tensor(b!) out) -> ()");
  // SwiGLU's activation (CPU, float32): out [M, D] = silu(x[:, :D]) * x[:, D:] for x [M, 2D]
  m.def("silu_and_mul(Tensor x, Tensor(a!) out) -> ()");
  // Half-rotation RoPE (CPU, float32): x [N, H, D] (rows may be strided), cos, sin [N, D/2] -> out [N, H, D]
  m.def("rope(Tensor x, Tensor cos, Tensor sin, Tensor(a!) out) -> ()");
}

// `import minisched.ops._C` loads this library (and so the registrations above). Its Python functions
// are the CPU kernels' ISA dispatch (csrc/cpu/cpu_isa.h) and thread pool (csrc/cpu/thread_pool.h),
// wrapped by minisched.ops.cpu:
//   cpu_features() -> dict    what cpuid and the OS allow, the supported variants, the active one
//   set_cpu_isa(name | None)  use variant `name` (None: the best supported); ValueError otherwise
//   cpu_pool() -> dict        the pool's spin_us and started workers
//   set_cpu_spin_us(int)      how long an idle worker spins before it sleeps (the caller checks >= 0)
namespace {

using minisched::cpu::Isa;

PyObject* py_cpu_features(PyObject*, PyObject*) {
  const auto& f = minisched::cpu::cpu_features();
  PyObject* d = PyDict_New();
  auto put = [d](const char* key, PyObject* v) {
    PyDict_SetItemString(d, key, v);
    Py_DECREF(v);
  };
  const std::pair<const char*, bool> flags[] = {
      {"avx2", f.avx2},
      {"fma", f.fma},
      {"f16c", f.f16c},
      {"avx_vnni", f.avx_vnni},
      {"avx512f", f.avx512f},
      {"avx512bw", f.avx512bw},
      {"avx512vl", f.avx512vl},
      {"avx512dq", f.avx512dq},
      {"avx512_vnni", f.avx512_vnni},
      {"avx512_bf16", f.avx512_bf16},
      {"avx512_fp16", f.avx512_fp16},
      {"amx_tile", f.amx_tile},
      {"amx_int8", f.amx_int8},
      {"amx_bf16", f.amx_bf16},
      {"os_ymm", f.os_ymm},
      {"os_zmm", f.os_zmm},
      {"os_amx", f.os_amx},
  };
  PyObject* cpu = PyDict_New();
  for (const auto& [name, on] : flags) PyDict_SetItemString(cpu, name, on ? Py_True : Py_False);
  put("flags", cpu);
  put("vendor", PyUnicode_FromString(f.vendor.c_str()));
  put("model", PyUnicode_FromString(f.model.c_str()));
  put("amx_error", PyUnicode_FromString(f.amx_error.c_str()));
  PyObject* supported = PyList_New(0);
  for (int i = 0; i < minisched::cpu::kNumIsas; ++i)
    if (minisched::cpu::isa_supported(static_cast<Isa>(i))) {
      PyObject* s = PyUnicode_FromString(minisched::cpu::isa_name(static_cast<Isa>(i)));
      PyList_Append(supported, s);
      Py_DECREF(s);
    }
  put("supported", supported);
  put("best", PyUnicode_FromString(minisched::cpu::isa_name(minisched::cpu::best_isa())));
  put("isa", PyUnicode_FromString(minisched::cpu::isa_name(minisched::cpu::isa())));
  return d;
}

PyObject* py_set_cpu_isa(PyObject*, PyObject* arg) {
  if (arg == Py_None) {
    minisched::cpu::set_isa(minisched::cpu::best_isa());
    Py_RETURN_NONE;
  }
  const char* name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : nullptr;
  if (name == nullptr) {
    PyErr_SetString(PyExc_TypeError, "set_cpu_isa: expected a str or None");
    return nullptr;
  }
  for (int i = 0; i < minisched::cpu::kNumIsas; ++i) {
    const Isa isa = static_cast<Isa>(i);
    if (std::strcmp(name, minisched::cpu::isa_name(isa)) != 0) continue;
    if (!minisched::cpu::isa_supported(isa)) {
      PyErr_Format(PyExc_ValueError, "set_cpu_isa: this machine cannot run %s", name);
      return nullptr;
    }
    minisched::cpu::set_isa(isa);
    Py_RETURN_NONE;
  }
  PyErr_Format(PyExc_ValueError, "set_cpu_isa: unknown ISA %s", name);
  return nullptr;
}

PyObject* py_cpu_pool(PyObject*, PyObject*) {
  return Py_BuildValue("{s:L,s:i}", "spin_us", static_cast<long long>(minisched::cpu::spin_us()), "workers",
                       minisched::cpu::pool_workers());
}

PyObject* py_set_cpu_spin_us(PyObject*, PyObject* arg) {
  const long long us = PyLong_AsLongLong(arg);
  if (us == -1 && PyErr_Occurred()) return nullptr;
  minisched::cpu::set_spin_us(us);
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"cpu_features", py_cpu_features, METH_NOARGS, "CPU features, supported kernel variants, the active one"},
    {"set_cpu_isa", py_set_cpu_isa, METH_O, "Use the CPU kernel variant `name` (None: the best supported)"},
    {"cpu_pool", py_cpu_pool, METH_NOARGS, "The CPU kernels' thread pool: spin_us, workers"},
    {"set_cpu_spin_us", py_set_cpu_spin_us, METH_O, "How long an idle pool worker spins before it sleeps"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "minisched.ops._C", nullptr, -1, methods};
  return PyModule_Create(&module_def);
}
