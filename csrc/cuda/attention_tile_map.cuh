// Which rows a CTA of the paged attention kernel (attention_kernel.cu) computes: the device tile map
// of ragged launches (prefill, shared prefix) and locate_tile. Included by attention_kernel.cu and
// attention_wgmma.cu (anonymous namespace: a copy per translation unit).
#pragma once

#include "cuda/attention_utils.cuh"

namespace minisched::cuda {
namespace {

// Which request and which row tile of it CTA column x works on (decode: x = b * tiles_per_request
// + tile; ragged: the device tile map, a request's last tiles first). ok = false: a spare CTA.
struct TileLoc {
  int b, tile, q_start, qo_len;
  bool ok;
};
__device__ __forceinline__ TileLoc locate_tile(const AttentionParams& p, int x) {
  TileLoc t{};
  if (p.qo_indptr == nullptr) {
    t.b = x / p.tiles_per_request;
    t.tile = x % p.tiles_per_request;
    t.q_start = t.b;
    t.qo_len = 1;
    t.ok = true;
    return t;
  }
  t.ok = x < p.tile_offsets[p.batch];
  if (!t.ok) return t;
  int lo = 0, hi = p.batch - 1;  // largest b with tile_offsets[b] <= x
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (p.tile_offsets[mid] <= x)
      lo = mid;
    else
      hi = mid - 1;
  }
  t.b = lo;
  const int ntiles = p.tile_offsets[lo + 1] - p.tile_offsets[lo];
  t.tile = ntiles - 1 - (x - p.tile_offsets[lo]);  // the last (heaviest when causal) tiles first
  t.q_start = p.qo_indptr[lo];
  t.qo_len = p.qo_indptr[lo + 1] - t.q_start;  // the tile map gave 0 tiles to invalid ranges
  return t;
}

// tile_offsets[b] = sum over b' < b of ceil(qo_len_b' * group / rows_tile); invalid ranges get 0
// tiles. One block; each thread scans a contiguous run of requests.
__global__ void __launch_bounds__(1024)
    tile_map_kernel(const int32_t* qo_indptr, int batch, int num_qo, int group, int rows_tile, int32_t* tile_offsets) {
  __shared__ int sums[1024];
  const int t = threadIdx.x, n = blockDim.x;
  const int per = (batch + n - 1) / n;
  const int b0 = min(batch, t * per), b1 = min(batch, b0 + per);
  auto tiles_of = [&](int b) {
    const int q0 = qo_indptr[b], q1 = qo_indptr[b + 1];
    if (q0 < 0 || q1 < q0 || q1 > num_qo) return 0;
    return int(((long long)(q1 - q0) * group + rows_tile - 1) / rows_tile);
  };
  int local = 0;
  for (int b = b0; b < b1; ++b) local += tiles_of(b);
  sums[t] = local;
  __syncthreads();
  for (int off = 1; off < n; off <<= 1) {
    const int v = t >= off ? sums[t - off] : 0;
    __syncthreads();
    sums[t] += v;
    __syncthreads();
  }
  int run = sums[t] - local;
  for (int b = b0; b < b1; ++b) {
    tile_offsets[b] = run;
    run += tiles_of(b);
  }
  if (t == n - 1) tile_offsets[batch] = sums[t];
}

// The grid's x extent, known on the host without reading any index value: ragged launches get an
// upper bound on the tile map's total (every request's ceil rounding adds < 1 tile), decode one
// column per (request, row tile).
inline long long grid_columns(const AttentionParams& p, int rows_tile) {
  if (p.qo_indptr != nullptr) return ((long long)p.num_qo * p.group + rows_tile - 1) / rows_tile + p.batch;
  return (long long)p.batch * ((p.group + rows_tile - 1) / rows_tile);
}

}  // namespace
}  // namespace minisched::cuda
