// Host-side input checks shared by the CPU (.cpp) and CUDA (.cu) host wrappers.
//
// They mirror minisched/ops/checks.py: the same exception types with the same key words, each
// message starting with "<op>: ".
//
//   TypeError   (TORCH_CHECK_TYPE)   wrong dtype                        "dtype"
//   ValueError  (TORCH_CHECK_VALUE)  wrong shape / device / layout      "shape", "device", "contiguous",
//                                    bad page table                      "page_size", "indptr",
//                                                                        "last_page_len", "qo_len"
//   IndexError  (TORCH_CHECK_INDEX)  page or slot index out of range    "out of range"
//
// Every check_<op>() runs the shape/dtype/device/contiguity checks always and the checks that
// read index values only when the index tensors live on the CPU (a CUDA page table was validated
// on the host before upload; reading it here would synchronize). The value checks are also
// exported one by one (check_page_table_values, ...) for wrappers that hold a host copy.
//
// The native kernels take fp32, bf16 and fp16 (check_float); float64 is the reference's alone.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace minisched::checks {

inline std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return "torch.float32";
    case at::kDouble:
      return "torch.float64";
    case at::kHalf:
      return "torch.float16";
    case at::kBFloat16:
      return "torch.bfloat16";
    case at::kInt:
      return "torch.int32";
    case at::kLong:
      return "torch.int64";
    case at::kShort:
      return "torch.int16";
    case at::kChar:
      return "torch.int8";
    case at::kByte:
      return "torch.uint8";
    case at::kBool:
      return "torch.bool";
    default:
      return std::string("torch.") + c10::toString(t);
  }
}

inline std::string shape_str(at::IntArrayRef s) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < s.size(); ++i) os << s[i] << (s.size() == 1 ? "," : (i + 1 < s.size() ? ", " : ""));
  os << ")";
  return os.str();
}

// -- single-tensor checks ------------------------------------------------------------------------

inline void check_dtype(const char* op, const char* name, const at::Tensor& t,
                        std::initializer_list<at::ScalarType> dtypes) {
  for (auto d : dtypes)
    if (t.scalar_type() == d) return;
  std::string allowed;
  for (auto d : dtypes) allowed += (allowed.empty() ? "" : ", ") + dtype_name(d);
  TORCH_CHECK_TYPE(false, op, ": ", name, " has dtype ", dtype_name(t.scalar_type()), ", expected one of (", allowed,
                   ")", t.scalar_type() == at::kDouble ? " (float64 runs only on the torch reference backend)" : "");
}

// The native kernels' float dtypes: fp32, bf16, fp16 (float64 is the torch reference's alone).
inline void check_float(const char* op, const char* name, const at::Tensor& t) {
  check_dtype(op, name, t, {at::kFloat, at::kBFloat16, at::kHalf});
}

inline void check_same_dtype(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                             const at::Tensor& ref) {
  TORCH_CHECK_TYPE(t.scalar_type() == ref.scalar_type(), op, ": ", name, " has dtype ", dtype_name(t.scalar_type()),
                   ", expected ", dtype_name(ref.scalar_type()), " like ", ref_name);
}

inline void check_shape(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef shape) {
  TORCH_CHECK_VALUE(t.sizes() == shape, op, ": ", name, " has shape ", shape_str(t.sizes()), ", expected ",
                    shape_str(shape));
}

inline void check_dim(const char* op, const char* name, const at::Tensor& t, int64_t ndim) {
  TORCH_CHECK_VALUE(t.dim() == ndim, op, ": ", name, " must have ", ndim, " dims (shape ", shape_str(t.sizes()), ")");
}

inline void check_contiguous(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

inline void check_device(const char* op, const char* name, const at::Tensor& t, const at::Device& device) {
  TORCH_CHECK_VALUE(t.device() == device, op, ": ", name, " is on device ", t.device(), ", expected ", device);
}

inline void check_index(const char* op, const char* name, const at::Tensor& t, const at::Device& device,
                        int64_t ndim = 1) {
  check_dtype(op, name, t, {at::kInt});
  check_dim(op, name, t, ndim);
  check_contiguous(op, name, t);
  check_device(op, name, t, device);
}

// -- index-value checks (CPU tensors only) -------------------------------------------------------

inline const int32_t* host_ints(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": ", name, " must be on the CPU (device) for a value check");
  return t.data_ptr<int32_t>();
}

// Every value of t in [lo, hi).
inline void check_range(const char* op, const char* name, const at::Tensor& t, int64_t lo, int64_t hi) {
  const int32_t* p = host_ints(op, name, t);
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK_INDEX(p[i] >= lo && p[i] < hi, op, ": ", name, " value ", p[i], " out of range [", lo, ", ", hi, ")");
}

inline std::string head_str(const int32_t* p, int64_t n) {
  std::ostringstream os;
  os << "[";
  for (int64_t i = 0; i < n && i < 8; ++i) os << (i ? ", " : "") << p[i];
  os << (n > 8 ? ", ...]" : "]");
  return os.str();
}

// CSR page table: indptr starts at 0, is non-decreasing (a request with no pages is an empty KV
// range, length 0), ends at len(indices); 1 <= last_page_len <= page_size; indices in [0, num_pages).
inline void check_page_table_values(const char* op, const std::string& prefix, const at::Tensor& indptr,
                                    const at::Tensor& indices, const at::Tensor& last, int64_t num_pages,
                                    int64_t page_size) {
  const int32_t* ip = host_ints(op, "kv_indptr", indptr);
  const int64_t batch = indptr.numel() - 1;
  bool ok = ip[0] == 0 && ip[batch] == indices.numel();
  for (int64_t b = 0; ok && b < batch; ++b) ok = ip[b + 1] >= ip[b];
  TORCH_CHECK_VALUE(ok, op, ": ", prefix,
                    "kv_indptr must start at 0, be non-decreasing and end at "
                    "len(kv_indices)=",
                    indices.numel(), "; got ", head_str(ip, indptr.numel()));
  const int32_t* lp = host_ints(op, "kv_last_page_len", last);
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK_VALUE(lp[b] >= 1 && lp[b] <= page_size, op, ": ", prefix,
                      "kv_last_page_len must be in 1..page_size=", page_size, " (request ", b, " has ", lp[b], ")");
  check_range(op, (prefix + "kv_indices").c_str(), indices, 0, num_pages);
}

// qo_indptr / group_indptr: starts at 0, non-decreasing, ends at n.
inline void check_qo_indptr_values(const char* op, const char* name, const at::Tensor& indptr, int64_t n) {
  const int32_t* ip = host_ints(op, name, indptr);
  const int64_t batch = indptr.numel() - 1;
  bool ok = ip[0] == 0 && ip[batch] == n;
  for (int64_t b = 0; ok && b < batch; ++b) ok = ip[b + 1] >= ip[b];
  TORCH_CHECK_VALUE(ok, op, ": ", name, " must start at 0, be non-decreasing and end at ", n, "; got ",
                    head_str(ip, indptr.numel()));
}

// Prefill: every request's qo_len <= kv_len (its queries are the last qo_len positions of its KV).
inline void check_qo_len_values(const char* op, const at::Tensor& qo_indptr, const at::Tensor& kv_indptr,
                                const at::Tensor& last, int64_t page_size) {
  const int32_t* qo = host_ints(op, "qo_indptr", qo_indptr);
  const int32_t* kv = host_ints(op, "kv_indptr", kv_indptr);
  const int32_t* lp = host_ints(op, "kv_last_page_len", last);
  for (int64_t b = 0; b + 1 < qo_indptr.numel(); ++b) {
    const int64_t qo_len = qo[b + 1] - qo[b];
    const int64_t kv_len = kv[b + 1] > kv[b] ? int64_t(kv[b + 1] - kv[b] - 1) * page_size + lp[b] : 0;
    TORCH_CHECK_VALUE(qo_len <= kv_len, op, ": request ", b, ": qo_len ", qo_len, " > kv_len ", kv_len);
  }
}

// -- shared groups -------------------------------------------------------------------------------

// One layer's caches [num_pages, page_size, Hkv, D]: same dtype/shape/device, contiguous.
inline void check_cache_pair(const char* op, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  check_float(op, "k_cache", k_cache);
  check_dim(op, "k_cache", k_cache, 4);
  check_same_dtype(op, "v_cache", v_cache, "k_cache", k_cache);
  TORCH_CHECK_VALUE(v_cache.sizes() == k_cache.sizes(), op, ": v_cache shape ", shape_str(v_cache.sizes()),
                    " != k_cache shape ", shape_str(k_cache.sizes()), " (num_pages, page_size, Hkv, D must match)");
  check_device(op, "v_cache", v_cache, k_cache.device());
  check_contiguous(op, "k_cache", k_cache);
  check_contiguous(op, "v_cache", v_cache);
  TORCH_CHECK_VALUE(k_cache.size(1) >= 1, op, ": k_cache page_size must be >= 1 (shape ", shape_str(k_cache.sizes()),
                    ")");
  TORCH_CHECK_VALUE(k_cache.size(2) >= 1 && k_cache.size(3) >= 1, op, ": k_cache shape ", shape_str(k_cache.sizes()),
                    " needs Hkv >= 1 and D >= 1");
}

inline void check_page_table(const char* op, const std::string& prefix, const at::Tensor& indptr,
                             const at::Tensor& indices, const at::Tensor& last, int64_t batch, int64_t num_pages,
                             int64_t page_size, const at::Device& device, bool values) {
  check_index(op, (prefix + "kv_indptr").c_str(), indptr, device);
  check_index(op, (prefix + "kv_indices").c_str(), indices, device);
  check_index(op, (prefix + "kv_last_page_len").c_str(), last, device);
  check_shape(op, (prefix + "kv_indptr").c_str(), indptr, {batch + 1});
  check_shape(op, (prefix + "kv_last_page_len").c_str(), last, {batch});
  if (values) check_page_table_values(op, prefix, indptr, indices, last, num_pages, page_size);
}

// q [N, Hq, D] against caches [.., Hkv, D]: same dtype/device, Hq % Hkv == 0; out like q.
inline void check_query(const char* op, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& out) {
  check_dim(op, "q", q, 3);
  check_same_dtype(op, "q", q, "k_cache", k_cache);
  check_device(op, "q", q, k_cache.device());
  check_contiguous(op, "q", q);
  const int64_t hkv = k_cache.size(2), d = k_cache.size(3);
  TORCH_CHECK_VALUE(q.size(2) == d, op, ": q head_dim ", q.size(2), " != cache head_dim ", d, " (shape mismatch)");
  TORCH_CHECK_VALUE(q.size(1) % hkv == 0, op, ": q heads ", q.size(1), " not a multiple of kv heads ", hkv,
                    " (shape mismatch)");
  check_shape(op, "out", out, q.sizes());
  check_same_dtype(op, "out", out, "q", q);
  check_device(op, "out", out, q.device());
  check_contiguous(op, "out", out);
}

inline void check_lse(const char* op, const std::optional<at::Tensor>& lse, const at::Tensor& q) {
  if (!lse.has_value()) return;
  check_dtype(op, "lse", *lse, {at::kFloat});
  check_shape(op, "lse", *lse, q.sizes().slice(0, 2));
  check_device(op, "lse", *lse, q.device());
  check_contiguous(op, "lse", *lse);
}

// The pool [L, 2, num_pages, page_size, Hkv, D].
inline void check_pool(const char* op, const at::Tensor& kv_cache) {
  check_float(op, "kv_cache", kv_cache);
  check_dim(op, "kv_cache", kv_cache, 6);
  check_contiguous(op, "kv_cache", kv_cache);
  TORCH_CHECK_VALUE(kv_cache.size(1) == 2, op, ": kv_cache shape ", shape_str(kv_cache.sizes()),
                    " must be [L, 2, num_pages, page_size, Hkv, D]");
}

// A page buffer [L, 2, n, page_size, Hkv, D] on any device, same dtype as the pool.
inline void check_buffer(const char* op, const char* name, const at::Tensor& buf, const at::Tensor& kv_cache,
                         const at::Tensor& pages) {
  check_same_dtype(op, name, buf, "kv_cache", kv_cache);
  check_contiguous(op, name, buf);
  if (buf.dim() == 6)
    TORCH_CHECK_VALUE(buf.size(3) == kv_cache.size(3), op, ": ", name, " page_size ", buf.size(3),
                      " != kv_cache page_size ", kv_cache.size(3));
  std::vector<int64_t> expect(kv_cache.sizes().begin(), kv_cache.sizes().end());
  expect[2] = pages.size(0);
  check_shape(op, name, buf, expect);
}

inline bool on_cpu(std::initializer_list<const at::Tensor*> ts) {
  for (auto* t : ts)
    if (!t->device().is_cpu()) return false;
  return true;
}

// -- one function per op: the op's argument list (values read only from CPU index tensors) -------

inline void check_store_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  const char* op = "store_kv";
  check_cache_pair(op, k_cache, v_cache);
  const int64_t hkv = k_cache.size(2), d = k_cache.size(3);
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"k", &k}, {"v", &v}}) {
    check_same_dtype(op, name, *t, "k_cache", k_cache);
    check_device(op, name, *t, k_cache.device());
    check_dim(op, name, *t, 3);
    check_shape(op, name, *t, {k.size(0), hkv, d});
  }
  check_index(op, "slot_mapping", slot_mapping, k_cache.device());
  check_shape(op, "slot_mapping", slot_mapping, {k.size(0)});
  if (slot_mapping.device().is_cpu()) {
    const int64_t slots = k_cache.size(0) * k_cache.size(1);
    const int32_t* s = slot_mapping.data_ptr<int32_t>();
    for (int64_t i = 0; i < slot_mapping.numel(); ++i)
      TORCH_CHECK_INDEX(s[i] < slots, op, ": slot_mapping value ", s[i], " out of range [0, ", slots, ")");
  }
}

inline void check_copy_kv_pages(const at::Tensor& kv_cache, const at::Tensor& src_pages, const at::Tensor& dst_pages) {
  const char* op = "copy_kv_pages";
  check_pool(op, kv_cache);
  check_index(op, "src_pages", src_pages, kv_cache.device());
  check_index(op, "dst_pages", dst_pages, kv_cache.device());
  check_shape(op, "dst_pages", dst_pages, src_pages.sizes());
  if (kv_cache.device().is_cpu()) {
    check_range(op, "src_pages", src_pages, 0, kv_cache.size(2));
    check_range(op, "dst_pages", dst_pages, 0, kv_cache.size(2));
    // Copies run in parallel on every backend: a page written must not be read or written twice.
    std::vector<char> role(kv_cache.size(2), 0);
    const int32_t* src = host_ints(op, "src_pages", src_pages);
    const int32_t* dst = host_ints(op, "dst_pages", dst_pages);
    for (int64_t i = 0; i < dst_pages.numel(); ++i) {
      TORCH_CHECK_VALUE(!role[dst[i]], op, ": dst_pages must be distinct (page ", dst[i], " repeats)");
      role[dst[i]] = 1;
    }
    for (int64_t i = 0; i < src_pages.numel(); ++i)
      TORCH_CHECK_VALUE(!role[src[i]], op, ": src_pages and dst_pages must be disjoint (page ", src[i], ")");
  }
}

// gather (name "out") and scatter (name "src") share their checks.
inline void check_move_kv_pages(const char* op, const char* buf_name, const at::Tensor& kv_cache,
                                const at::Tensor& pages, const at::Tensor& buf) {
  check_pool(op, kv_cache);
  check_index(op, "pages", pages, kv_cache.device());
  check_buffer(op, buf_name, buf, kv_cache, pages);
  if (pages.device().is_cpu()) check_range(op, "pages", pages, 0, kv_cache.size(2));
}

inline void check_paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                         const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                                         const at::Tensor& kv_last_page_len, const at::Tensor& out,
                                         const std::optional<at::Tensor>& lse) {
  const char* op = "paged_decode_attention";
  check_cache_pair(op, k_cache, v_cache);
  check_query(op, q, k_cache, out);
  check_lse(op, lse, q);
  check_page_table(op, "", kv_indptr, kv_indices, kv_last_page_len, q.size(0), k_cache.size(0), k_cache.size(1),
                   q.device(), q.device().is_cpu());
}

inline void check_paged_prefill_attention(const at::Tensor& q, const at::Tensor& qo_indptr, const at::Tensor& k_cache,
                                          const at::Tensor& v_cache, const at::Tensor& kv_indptr,
                                          const at::Tensor& kv_indices, const at::Tensor& kv_last_page_len,
                                          const at::Tensor& out, const std::optional<at::Tensor>& lse,
                                          int64_t kernel = 0) {
  const char* op = "paged_prefill_attention";
  TORCH_CHECK_VALUE(kernel >= 0 && kernel <= 2, op, ": kernel must be 0 (auto), 1 (mma.sync) or 2 (wgmma), got ",
                    kernel);
  check_cache_pair(op, k_cache, v_cache);
  check_query(op, q, k_cache, out);
  check_lse(op, lse, q);
  check_index(op, "qo_indptr", qo_indptr, q.device());
  const int64_t batch = qo_indptr.size(0) - 1;
  TORCH_CHECK_VALUE(batch >= 0, op, ": qo_indptr must have shape [B+1] (got an empty tensor)");
  const bool values = q.device().is_cpu();
  check_page_table(op, "", kv_indptr, kv_indices, kv_last_page_len, batch, k_cache.size(0), k_cache.size(1), q.device(),
                   values);
  if (values) {
    check_qo_indptr_values(op, "qo_indptr", qo_indptr, q.size(0));
    check_qo_len_values(op, qo_indptr, kv_indptr, kv_last_page_len, k_cache.size(1));
  }
}

inline void check_shared_prefix_attention(const at::Tensor& q, const at::Tensor& group_indptr,
                                          const at::Tensor& k_cache, const at::Tensor& v_cache,
                                          const at::Tensor& prefix_kv_indptr, const at::Tensor& prefix_kv_indices,
                                          const at::Tensor& prefix_kv_last_page_len, const at::Tensor& out,
                                          const at::Tensor& lse) {
  const char* op = "shared_prefix_attention";
  check_cache_pair(op, k_cache, v_cache);
  check_query(op, q, k_cache, out);
  check_lse(op, lse, q);
  check_index(op, "group_indptr", group_indptr, q.device());
  const int64_t groups = group_indptr.size(0) - 1;
  TORCH_CHECK_VALUE(groups >= 0, op, ": group_indptr must have shape [G+1] (got an empty tensor)");
  const bool values = q.device().is_cpu();
  check_page_table(op, "prefix_", prefix_kv_indptr, prefix_kv_indices, prefix_kv_last_page_len, groups, k_cache.size(0),
                   k_cache.size(1), q.device(), values);
  if (values) check_qo_indptr_values(op, "group_indptr", group_indptr, q.size(0));
}

inline void check_merge_attention_states(const at::Tensor& v_a, const at::Tensor& lse_a, const at::Tensor& v_b,
                                         const at::Tensor& lse_b, const at::Tensor& v_out, const at::Tensor& lse_out) {
  const char* op = "merge_attention_states";
  check_float(op, "v_a", v_a);
  check_dim(op, "v_a", v_a, 3);
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"v_b", &v_b}, {"v_out", &v_out}}) {
    check_same_dtype(op, name, *t, "v_a", v_a);
    check_shape(op, name, *t, v_a.sizes());
  }
  for (auto [name, t] :
       {std::pair<const char*, const at::Tensor*>{"lse_a", &lse_a}, {"lse_b", &lse_b}, {"lse_out", &lse_out}}) {
    check_dtype(op, name, *t, {at::kFloat});
    check_shape(op, name, *t, v_a.sizes().slice(0, 2));
  }
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"v_a", &v_a},
                         {"lse_a", &lse_a},
                         {"v_b", &v_b},
                         {"lse_b", &lse_b},
                         {"v_out", &v_out},
                         {"lse_out", &lse_out}}) {
    check_device(op, name, *t, v_a.device());
    check_contiguous(op, name, *t);
  }
}

// int8 linear: x [M, K] float32 (rows may be strided, elements contiguous), w_packed [P, K / 2, 32] int8
// and s_packed [P, K / G, 16] float32 (P = ceil(N / 16) panels, G = group size, a multiple of 32 dividing
// K), out [M, N] float32.
inline void check_int8_linear(const at::Tensor& x, const at::Tensor& w_packed, const at::Tensor& s_packed,
                              const at::Tensor& out) {
  const char* op = "int8_linear";
  check_dtype(op, "x", x, {at::kFloat});
  check_dim(op, "x", x, 2);
  check_dtype(op, "w_packed", w_packed, {at::kChar});
  check_dim(op, "w_packed", w_packed, 3);
  check_dtype(op, "s_packed", s_packed, {at::kFloat});
  check_dim(op, "s_packed", s_packed, 3);
  check_dtype(op, "out", out, {at::kFloat});
  check_dim(op, "out", out, 2);
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1), panels = (n + 15) / 16, groups = s_packed.size(1);
  TORCH_CHECK_VALUE(k % 2 == 0 && w_packed.size(0) == panels && w_packed.size(1) == k / 2 && w_packed.size(2) == 32, op,
                    ": w_packed has shape ", shape_str(w_packed.sizes()), ", expected (", panels, ", ", k / 2,
                    ", 32) for x ", shape_str(x.sizes()), " and out ", shape_str(out.sizes()));
  TORCH_CHECK_VALUE(
      s_packed.size(0) == panels && s_packed.size(2) == 16 && groups >= 1 && k % groups == 0 && (k / groups) % 32 == 0,
      op, ": s_packed has shape ", shape_str(s_packed.sizes()), "; expected (", panels,
      ", K / group_size, 16) with a group_size that divides K=", k, " and is a multiple of 32");
  check_shape(op, "out", out, {m, n});
  TORCH_CHECK_VALUE(x.stride(1) == 1, op, ": x must have contiguous rows (stride(1) == 1)");
  for (auto [name, t] :
       {std::pair<const char*, const at::Tensor*>{"w_packed", &w_packed}, {"s_packed", &s_packed}, {"out", &out}}) {
    check_device(op, name, *t, x.device());
    check_contiguous(op, name, *t);
  }
}

// Packed linear: x [M, K] float32 (rows may be strided, elements contiguous), w_packed [P, K, 16] float32
// or bfloat16 (panels of 16 output columns, P = ceil(N / 16)), out [M, N] float32.
inline void check_packed_linear(const at::Tensor& x, const at::Tensor& w_packed, const at::Tensor& out) {
  const char* op = "packed_linear";
  check_dtype(op, "x", x, {at::kFloat});
  check_dim(op, "x", x, 2);
  check_dtype(op, "w_packed", w_packed, {at::kFloat, at::kBFloat16});
  check_dim(op, "w_packed", w_packed, 3);
  check_dtype(op, "out", out, {at::kFloat});
  check_dim(op, "out", out, 2);
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1), panels = (n + 15) / 16;
  TORCH_CHECK_VALUE(w_packed.size(0) == panels && w_packed.size(1) == k && w_packed.size(2) == 16, op,
                    ": w_packed has shape ", shape_str(w_packed.sizes()), ", expected (", panels, ", ", k,
                    ", 16) for x ", shape_str(x.sizes()), " and out ", shape_str(out.sizes()),
                    " (pack the [N, K] weight with minisched.ops.pack_linear_weight)");
  check_shape(op, "out", out, {m, n});
  TORCH_CHECK_VALUE(x.stride(1) == 1 || k <= 1, op, ": x must have contiguous rows (stride(1) == 1)");
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"w_packed", &w_packed}, {"out", &out}}) {
    check_device(op, name, *t, x.device());
    check_contiguous(op, name, *t);
  }
}

// The GGUF block linears (gguf_linear, gguf_a8_linear): x [M, K] float32 (rows may be strided, elements
// contiguous; K a multiple of 32, GGUF's block), w_packed [P, K / 32, width x block bytes] of w_dtype (made
// by ops.<pack>: panels of 16 rows, P = ceil(N / 16)), qtype a GGML type id of a supported block format
// (2 Q4_0, 3 Q4_1, 8 Q8_0), out [M, N] float32.
inline void check_gguf_blocks(const char* op, const at::Tensor& x, const at::Tensor& w_packed, int64_t qtype,
                              const at::Tensor& out, at::ScalarType w_dtype, int64_t width, const char* pack) {
  TORCH_CHECK_VALUE(qtype == 2 || qtype == 3 || qtype == 8, op, ": qtype ", qtype,
                    " is not a supported block format (GGML type ids: 2 Q4_0, 3 Q4_1, 8 Q8_0)");
  const int64_t block_bytes = qtype == 2 ? 18 : (qtype == 3 ? 20 : 34);
  check_dtype(op, "x", x, {at::kFloat});
  check_dim(op, "x", x, 2);
  TORCH_CHECK_TYPE(w_packed.scalar_type() == w_dtype, op, ": w_packed has dtype ", w_packed.scalar_type(),
                   ", expected ", w_dtype, " (pack the blocks with minisched.ops.", pack, ")");
  check_dim(op, "w_packed", w_packed, 3);
  check_dtype(op, "out", out, {at::kFloat});
  check_dim(op, "out", out, 2);
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1), panels = (n + 15) / 16;
  TORCH_CHECK_VALUE(k % 32 == 0, op, ": K=", k, " (x ", shape_str(x.sizes()),
                    ") is not a multiple of 32, the GGUF block size");
  TORCH_CHECK_VALUE(w_packed.size(0) == panels && w_packed.size(1) == k / 32 && w_packed.size(2) == width * block_bytes,
                    op, ": w_packed has shape ", shape_str(w_packed.sizes()), ", expected (", panels, ", ", k / 32,
                    ", ", width * block_bytes, ") for x ", shape_str(x.sizes()), ", out ", shape_str(out.sizes()),
                    " and qtype ", qtype, " (pack the blocks with minisched.ops.", pack, ")");
  check_shape(op, "out", out, {m, n});
  TORCH_CHECK_VALUE(x.stride(1) == 1 || k <= 1, op, ": x must have contiguous rows (stride(1) == 1)");
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"w_packed", &w_packed}, {"out", &out}}) {
    check_device(op, name, *t, x.device());
    check_contiguous(op, name, *t);
  }
}

// gguf_linear: w_packed uint8 [P, K / 32, 16 x block bytes] (ops.pack_gguf_weight).
inline void check_gguf_linear(const at::Tensor& x, const at::Tensor& w_packed, int64_t qtype, const at::Tensor& out) {
  check_gguf_blocks("gguf_linear", x, w_packed, qtype, out, at::kByte, 16, "pack_gguf_weight");
}

inline void check_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& delta, const at::Tensor& weight,
                           double eps, const at::Tensor& out) {
  const char* op = "rms_norm";
  check_dtype(op, "x", x, {at::kFloat});
  check_dim(op, "x", x, 2);
  check_contiguous(op, "x", x);
  check_dtype(op, "weight", weight, {at::kFloat});
  check_shape(op, "weight", weight, {x.size(1)});
  check_contiguous(op, "weight", weight);
  check_dtype(op, "out", out, {at::kFloat});
  check_shape(op, "out", out, {x.size(0), x.size(1)});
  check_contiguous(op, "out", out);
  TORCH_CHECK_VALUE(eps > 0 && std::isfinite(eps), op, ": eps must be a positive finite number, got ", eps);
  check_device(op, "weight", weight, x.device());
  check_device(op, "out", out, x.device());
  if (delta.has_value()) {
    check_dtype(op, "delta", *delta, {at::kFloat});
    check_shape(op, "delta", *delta, {x.size(0), x.size(1)});
    check_contiguous(op, "delta", *delta);
    check_device(op, "delta", *delta, x.device());
  }
}

// out must not share memory with an input the kernel reads while writing out: the byte spans of the two
// views of one storage must not intersect (at::get_overlap_status gives up on strided views).
inline void check_no_overlap(const char* op, const char* out_name, const at::Tensor& out, const char* in_name,
                             const at::Tensor& in) {
  if (out.numel() == 0 || in.numel() == 0 || !out.has_storage() || !in.has_storage()) return;
  if (out.storage().data() != in.storage().data()) return;
  const auto span = [](const at::Tensor& t) {
    int64_t last = t.storage_offset();
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    return std::pair<int64_t, int64_t>{t.storage_offset() * t.element_size(), (last + 1) * t.element_size()};
  };
  const auto [a0, a1] = span(out);
  const auto [b0, b1] = span(in);
  TORCH_CHECK_VALUE(a1 <= b0 || b1 <= a0, op, ": ", out_name, " overlaps ", in_name,
                    " (pass a separate output tensor)");
}

// gguf_a8_linear: w_packed int32 [P, K / 32, 4 x block bytes] (ops.pack_gguf_a8_weight: the same panel-blocks,
// each row's quant bytes in 32-bit lanes; the dtype tells the two layouts apart); out must not overlap x.
inline void check_gguf_a8_linear(const at::Tensor& x, const at::Tensor& w_packed, int64_t qtype,
                                 const at::Tensor& out) {
  const char* op = "gguf_a8_linear";
  check_gguf_blocks(op, x, w_packed, qtype, out, at::kInt, 4, "pack_gguf_a8_weight");
  check_no_overlap(op, "out", out, "x", x);
}

inline void check_silu_and_mul(const at::Tensor& x, const at::Tensor& out) {
  const char* op = "silu_and_mul";
  check_dtype(op, "x", x, {at::kFloat});
  check_dim(op, "x", x, 2);
  check_contiguous(op, "x", x);
  TORCH_CHECK_VALUE(x.size(1) % 2 == 0, op, ": x's last dim must be even (gate and up halves), got ", x.size(1));
  check_dtype(op, "out", out, {at::kFloat});
  check_shape(op, "out", out, {x.size(0), x.size(1) / 2});
  check_contiguous(op, "out", out);
  check_device(op, "out", out, x.device());
  check_no_overlap(op, "out", out, "x", x);
}

inline void check_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& out) {
  const char* op = "rope";
  check_dtype(op, "x", x, {at::kFloat});
  check_dim(op, "x", x, 3);
  TORCH_CHECK_VALUE(x.size(2) % 2 == 0, op, ": x's head dim must be even, got ", x.size(2));
  TORCH_CHECK_VALUE(x.size(2) <= 1 || x.stride(2) == 1, op, ": x's last dim must be contiguous (stride 1), got ",
                    x.stride(2));
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"cos", cos}, {"sin", sin}}) {
    check_dtype(op, name, t, {at::kFloat});
    check_shape(op, name, t, {x.size(0), x.size(2) / 2});
    check_contiguous(op, name, t);
    check_device(op, name, t, x.device());
  }
  check_dtype(op, "out", out, {at::kFloat});
  check_shape(op, "out", out, {x.size(0), x.size(1), x.size(2)});
  check_contiguous(op, "out", out);
  check_device(op, "out", out, x.device());
  check_no_overlap(op, "out", out, "x", x);
}

}  // namespace minisched::checks
