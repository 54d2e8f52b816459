// The CPU attention inner loop shared by paged_decode_attention, paged_prefill_attention and
// shared_prefix_attention: ragged queries against a FlashInfer-style paged KV cache, read in
// place through the page table.
//
// Work item = (request b, kv head h, tile of query tokens). A tile holds up to kMaxRows query
// rows: Tq tokens x the G = Hq / Hkv query heads that share kv head h (GQA), so every K/V row
// is loaded once per tile and reused by all its rows. KV is streamed in blocks of kBlock
// tokens (crossing page boundaries, so page_size 1 costs the same as 16) with an online
// softmax per row: running max m, running sum l, fp32 accumulator acc rescaled by
// exp(m_old - m_new). Scores use q pre-scaled by sm_scale; lse = m + log(l) (natural log).
// Causal masking is bottom-right aligned: query token t of a request with qo_len queries over
// kv_len keys sees positions <= kv_len - qo_len + t. Items are pulled from an atomic counter
// by at::get_num_threads() workers (dynamic scheduling; causal tiles differ in cost).
// Inputs are fp32 / bf16 / fp16; 16-bit K/V blocks are widened to fp32 once per block.
// The block math (scores, softmax step, P.V; AVX2 where available) is in attention_kernels.h; on
// AVX-512 machines (head_dim % 16 == 0) the two block products run attention_avx512.cpp's variants, and
// tiles of 16 rows or more its lane-group step (16 rows per zmm: key-major scores, softmax across lanes).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include "cpu/attention_kernels.h"
#include "cpu/cpu_isa.h"
#include "cpu/isa_kernels.h"
#include "cpu/thread_pool.h"

#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace minisched::cpu {

// Calls f(scalar_t{}) for the native float dtypes (the checks already rejected the rest).
template <typename F>
void dispatch_float(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat:
      f(float{});
      break;
    case at::kBFloat16:
      f(c10::BFloat16{});
      break;
    case at::kHalf:
      f(c10::Half{});
      break;
    default:
      TORCH_CHECK_TYPE(false, "minisched: unsupported dtype ", t);
  }
}

struct AttnParams {
  const void* q;        // [N, Hq, D]
  void* out;            // [N, Hq, D]
  float* lse;           // [N, Hq] or nullptr
  const void* k_cache;  // [num_pages, page_size, Hkv, D]
  const void* v_cache;
  const int32_t* qo_indptr;  // [B+1]; nullptr: one query per request (decode, row b)
  const int32_t* kv_indptr;  // [B+1]
  const int32_t* kv_indices;
  const int32_t* kv_last_page_len;  // [B]
  int64_t batch, hq, hkv, d, page_size;
  float sm_scale;
  bool causal;
};

namespace detail {

template <typename scalar_t>
inline void widen(const scalar_t* __restrict src, float* __restrict dst, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]);
}

struct Item {
  int32_t b, t0, h;
};

// AVX-512 tiles of at least this many query rows run in lane groups of 16 rows (avx512::attn_block_lanes);
// smaller ones (decode: G rows) in the row-major block products.
constexpr int64_t kLaneRows = 16;

// Per-worker buffers, sized once per call (rows rounded up to whole lane groups).
struct Scratch {
  std::vector<float> q, acc, s, m, l, kbuf, vbuf, qt, pt;
  std::vector<int64_t> lim;
  std::vector<int32_t> lim32;
  std::vector<const float*> kp, vp;
  Scratch(int64_t rows, int64_t d)
      : q(rows * d),
        acc(lanes(rows) * d),
        s(rows * kBlock),
        m(lanes(rows)),
        l(lanes(rows)),
        kbuf(kBlock * d),
        vbuf(kBlock * d),
        qt(lanes(rows) * d),
        pt(kBlock * kLaneRows),
        lim(rows),
        lim32(lanes(rows)),
        kp(kBlock),
        vp(kBlock) {}
  static int64_t lanes(int64_t rows) { return (rows + kLaneRows - 1) / kLaneRows * kLaneRows; }
};

template <typename scalar_t, bool kWide>
void run_item(const AttnParams& p, const Item& it, int64_t tq, Scratch& w) {
  const int64_t d = p.d, g = p.hq / p.hkv, ps = p.page_size;
  const int64_t q0 = p.qo_indptr ? p.qo_indptr[it.b] : it.b;
  const int64_t qo_len = p.qo_indptr ? p.qo_indptr[it.b + 1] - q0 : 1;
  const int64_t t0 = it.t0, t1 = std::min<int64_t>(qo_len, t0 + tq);
  const int64_t rows = (t1 - t0) * g;
  const int32_t* pages = p.kv_indices + p.kv_indptr[it.b];
  const int64_t npages = p.kv_indptr[it.b + 1] - p.kv_indptr[it.b];  // 0: an empty range (o = 0, lse = -inf)
  const int64_t kv_len = npages > 0 ? (npages - 1) * ps + p.kv_last_page_len[it.b] : 0;
  const auto* q = static_cast<const scalar_t*>(p.q);
  const auto* kc = static_cast<const scalar_t*>(p.k_cache);
  const auto* vc = static_cast<const scalar_t*>(p.v_cache);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  // -- load the tile's query rows (row r = token (t0 + r / g), head h * g + r % g), pre-scaled --
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / g;
    const scalar_t* src = q + ((q0 + t) * p.hq + it.h * g + r % g) * d;
    float* dst = w.q.data() + r * d;
    for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]) * p.sm_scale;
    w.lim[r] = p.causal ? kv_len - qo_len + t : kv_len - 1;  // last visible KV position
    w.m[r] = kNegInf;
    w.l[r] = 0.f;
    std::fill_n(w.acc.data() + r * d, d, 0.f);
  }
  const int64_t kv_end = std::min(kv_len, w.lim[rows - 1] + 1);
  // Lane groups (AVX-512, prefill-sized tiles): q transposed per group of 16 rows, lanes past `rows`
  // zero (they see every key and are never written out).
  const bool lanes = kWide && rows >= kLaneRows;
  const int64_t groups = (rows + kLaneRows - 1) / kLaneRows;
  if (lanes) {
    for (int64_t r = 0; r < groups * kLaneRows; ++r) {
      float* qt = w.qt.data() + (r / kLaneRows) * d * kLaneRows + r % kLaneRows;
      for (int64_t i = 0; i < d; ++i) qt[i * kLaneRows] = r < rows ? w.q[r * d + i] : 0.f;
      w.lim32[r] = static_cast<int32_t>(r < rows ? w.lim[r] : kv_end);
      if (r >= rows) {
        w.m[r] = kNegInf;
        w.l[r] = 0.f;
        std::fill_n(w.acc.data() + r * d, d, 0.f);
      }
    }
  }

  // -- stream KV blocks through the page table ----------------------------------------------
  for (int64_t j0 = 0; j0 < kv_end; j0 += kBlock) {
    const int64_t n = std::min(kBlock, kv_end - j0);
    int64_t page = j0 / ps, in_page = j0 % ps;  // walked forward, no division per token
    for (int64_t j = 0; j < n; ++j) {
      const int64_t off = ((int64_t(pages[page]) * ps + in_page) * p.hkv + it.h) * d;
      if (++in_page == ps) in_page = 0, ++page;
      if constexpr (std::is_same_v<scalar_t, float>) {
        w.kp[j] = kc + off;
        w.vp[j] = vc + off;
      } else {
        widen(kc + off, w.kbuf.data() + j * d, d);
        widen(vc + off, w.vbuf.data() + j * d, d);
        w.kp[j] = w.kbuf.data() + j * d;
        w.vp[j] = w.vbuf.data() + j * d;
      }
    }
    // Prefetch the next block's K and V rows: a decode item reads each row once, at a page-table
    // address the hardware prefetcher cannot guess (a new page every page_size tokens, D floats of
    // every Hkv * D), so without this every row is a cache miss (3-6 GB/s of KV instead of 10+).
    if (j0 + kBlock < kv_end) {
      const int64_t n_next = std::min(kBlock, kv_end - j0 - kBlock);
      int64_t pg = (j0 + kBlock) / ps, ip = (j0 + kBlock) % ps;
      const int64_t bytes = d * static_cast<int64_t>(sizeof(scalar_t));
      for (int64_t j = 0; j < n_next; ++j) {
        const int64_t off = ((int64_t(pages[pg]) * ps + ip) * p.hkv + it.h) * d;
        if (++ip == ps) ip = 0, ++pg;
        const char* kr = reinterpret_cast<const char*>(kc + off);
        const char* vr = reinterpret_cast<const char*>(vc + off);
        for (int64_t b = 0; b < bytes; b += 64) {
          __builtin_prefetch(kr + b, 0, 3);
          __builtin_prefetch(vr + b, 0, 3);
        }
      }
    }
    // Causal rows are ordered by their limit: the rows that see this block are a suffix.
    int64_t r0 = 0;
    while (r0 < rows && w.lim[r0] < j0) ++r0;
    if (lanes) {
      for (int64_t gi = r0 / kLaneRows; gi < groups; ++gi) {
        const int64_t base = gi * kLaneRows;
        avx512::attn_block_lanes(w.qt.data() + base * d, d, w.kp.data(), w.vp.data(), n, j0, w.lim32.data() + base,
                                 std::min(kLaneRows, rows - base), w.m.data() + base, w.l.data() + base,
                                 w.acc.data() + base * d, w.pt.data());
      }
      continue;
    }
    float* S = w.s.data();
    if constexpr (kWide)
      avx512::attn_block_scores(w.q.data() + r0 * d, rows - r0, d, w.kp.data(), n, S + r0 * kBlock, kBlock);
    else
      block_scores(w.q.data() + r0 * d, rows - r0, d, w.kp.data(), n, S + r0 * kBlock);
    for (int64_t r = r0; r < rows; ++r) {                    // online softmax: scores -> probabilities in place
      const int64_t valid = std::min(n, w.lim[r] - j0 + 1);  // causal: keys past lim are masked
      float sum = 0.f;
      const float m_new = softmax_block(S + r * kBlock, valid, w.m[r], &sum);
      if (m_new > w.m[r] && w.m[r] != kNegInf) {  // rescale what was accumulated so far
        const float corr = std::exp(w.m[r] - m_new);
        float* acc = w.acc.data() + r * d;
        w.l[r] *= corr;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) acc[i] *= corr;
      }
      w.m[r] = m_new;
      w.l[r] += sum;
    }
    if constexpr (kWide)
      avx512::attn_block_accumulate(w.acc.data() + r0 * d, rows - r0, d, S + r0 * kBlock, kBlock, w.vp.data(), n);
    else
      block_accumulate(w.acc.data() + r0 * d, rows - r0, d, S + r0 * kBlock, w.vp.data(), n);
  }

  // -- normalize and write out ---------------------------------------------------------------
  auto* out = static_cast<scalar_t*>(p.out);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = (q0 + t0 + r / g) * p.hq + it.h * g + r % g;
    const float l = w.l[r];
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const float* acc = w.acc.data() + r * d;
    scalar_t* dst = out + row * d;
    for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<scalar_t>(acc[i] * inv);
    if (p.lse) p.lse[row] = l > 0.f ? w.m[r] + std::log(l) : kNegInf;
  }
}

}  // namespace detail

// Below this many (query row, KV token, q head) dot products (~2 MFLOP at head_dim 64) a call is
// not worth a parallel region.
constexpr int64_t kSerialWork = int64_t(1) << 13;

// Runs attention for every (request, kv head, query tile) of p; index values must be valid.
template <typename scalar_t>
void paged_attention(const AttnParams& p) {
  using namespace detail;
  const int64_t g = p.hq / p.hkv;
  const int64_t tq = std::max<int64_t>(1, kMaxRows / g);
  std::vector<Item> items;  // a request's last tiles first: under causal masking they cost the most
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t qo_len = p.qo_indptr ? p.qo_indptr[b + 1] - p.qo_indptr[b] : 1;
    for (int64_t t0 = (qo_len - 1) / tq * tq; t0 >= 0 && qo_len > 0; t0 -= tq)
      for (int64_t h = 0; h < p.hkv; ++h) items.push_back({int32_t(b), int32_t(t0), int32_t(h)});
  }
  if (items.empty()) return;
  const int64_t rows = tq * g;
  const int64_t n_items = static_cast<int64_t>(items.size());
  // Small jobs (a short decode of a few requests) run on the calling thread: opening a parallel
  // region wakes the other threads, which costs more than the work -- tens of microseconds on a
  // quiet machine, milliseconds when the cores are shared. Work = query rows x KV
  // tokens x q heads, an upper bound under causal masking.
  int64_t work = 0;
  for (int64_t b = 0; b < p.batch && work < kSerialWork; ++b) {
    const int64_t qo_len = p.qo_indptr ? p.qo_indptr[b + 1] - p.qo_indptr[b] : 1;
    const int64_t npages = p.kv_indptr[b + 1] - p.kv_indptr[b];
    const int64_t kv_len = npages > 0 ? (npages - 1) * p.page_size + p.kv_last_page_len[b] : 0;
    work += qo_len * kv_len * p.hq;
  }
  const int64_t workers = work < kSerialWork ? 1 : std::min<int64_t>(at::get_num_threads(), n_items);
  std::atomic<int64_t> next{0};
  const bool wide = use_avx512() && p.d % 16 == 0;
  parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch w(rows, p.d);
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n_items;) {
      if (wide)
        run_item<scalar_t, true>(p, items[i], tq, w);
      else
        run_item<scalar_t, false>(p, items[i], tq, w);
    }
  });
}

// Fills AttnParams from the (already checked) tensors and runs the kernel for q's dtype.
// qo_indptr == nullptr: one query per request (decode); lse may be null.
inline void run_paged_attention(const at::Tensor& q, const int32_t* qo_indptr, int64_t batch, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                                const at::Tensor& kv_last_page_len, bool causal, double sm_scale, const at::Tensor& out,
                                float* lse) {
  AttnParams p{};
  p.q = q.const_data_ptr();
  p.out = out.data_ptr();
  p.lse = lse;
  p.k_cache = k_cache.const_data_ptr();
  p.v_cache = v_cache.const_data_ptr();
  p.qo_indptr = qo_indptr;
  p.kv_indptr = kv_indptr.const_data_ptr<int32_t>();
  p.kv_indices = kv_indices.const_data_ptr<int32_t>();
  p.kv_last_page_len = kv_last_page_len.const_data_ptr<int32_t>();
  p.batch = batch;
  p.hq = q.size(1);
  p.hkv = k_cache.size(2);
  p.d = k_cache.size(3);
  p.page_size = k_cache.size(1);
  p.sm_scale = static_cast<float>(sm_scale);
  p.causal = causal;
  dispatch_float(q.scalar_type(), [&](auto tag) { paged_attention<decltype(tag)>(p); });
}

}  // namespace minisched::cpu
