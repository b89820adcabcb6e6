// CUDA layer and RMS norm. Rows are read and written in their storage type S (bfloat16 and
// float16 as they are); statistics and arithmetic are in T = compute_t<S>; weights, biases and
// their gradients are in W, either T or (16-bit rows with 16-bit weights) S, so that no
// conversion pass runs around the kernels.
//
// Rows of at most 1024 elements, a multiple of 8, on 16-byte boundaries (every model width) take
// the packed kernels: a warp per row, each lane moving 8 elements per 16-byte-aligned access.
// Their backward computes dx and the weight and bias gradients in one pass over g and x: each
// warp walks rows grid-stride, keeping its lanes' columns' running sums, the block folds its
// warps' sums in shared memory, and a last kernel adds the blocks' partial sums column by column
// in a fixed order (the same bits on every run on one device). Other rows take a block per row,
// and a second pass over row chunks for the parameter gradients.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "weave/kernels/backends.h"
#include "weave/kernels/cuda/rows.cuh"

namespace weave::kernels::cuda {

namespace {

constexpr int kPack = 8, kWarpsPerBlock = kThreads / 32, kMaxPacksPerLane = 4;
constexpr int64_t kMaxPackedRow = int64_t(32) * kPack * kMaxPacksPerLane;  // 1024
constexpr size_t kMaxSharedBytes = 48 * 1024;

template <class S>
struct alignas(16) Pack {
  S v[kPack];
};

template <class S, class T>
__device__ inline void load_pack(const S* p, T (&out)[kPack]) {
  const Pack<S> pack = *reinterpret_cast<const Pack<S>*>(p);
#pragma unroll
  for (int e = 0; e < kPack; ++e) out[e] = T(pack.v[e]);
}

template <class S, class T>
__device__ inline void store_pack(S* p, const T (&in)[kPack]) {
  Pack<S> pack;
#pragma unroll
  for (int e = 0; e < kPack; ++e) pack.v[e] = S(in[e]);
  *reinterpret_cast<Pack<S>*>(p) = pack;
}

/// The first column of lane's p-th pack in a row.
__device__ inline int pack_column(int p, int lane) {
  return (p * 32 + lane) * kPack;
}

template <class S, class W, int kPacks, class T = compute_t<S>>
__global__ void __launch_bounds__(kThreads)
    layer_norm_packed_kernel(const S* x, const W* w, const W* b, T eps, bool rms, S* out, T* mean,
                             T* rstd, int64_t rows, int n) {
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;  // the whole warp
  const int lane = threadIdx.x % 32;
  T v[kPacks][kPack], sum = 0;
#pragma unroll
  for (int p = 0; p < kPacks; ++p) {
    const int j = pack_column(p, lane);
    if (j < n) load_pack(x + row * n + j, v[p]);
#pragma unroll
    for (int e = 0; e < kPack; ++e) {
      if (j >= n) v[p][e] = T(0);
      sum += v[p][e];
    }
  }
  const T mu = rms ? T(0) : warp_reduce(sum, Combine::Sum) / T(n);
  T squares = 0;
#pragma unroll
  for (int p = 0; p < kPacks; ++p)
    if (pack_column(p, lane) < n)
#pragma unroll
      for (int e = 0; e < kPack; ++e) squares += (v[p][e] - mu) * (v[p][e] - mu);
  const T r = T(1) / sqrt(warp_reduce(squares, Combine::Sum) / T(n) + eps);
  if (lane == 0) {
    if (mean) mean[row] = mu;
    rstd[row] = r;
  }
#pragma unroll
  for (int p = 0; p < kPacks; ++p) {
    const int j = pack_column(p, lane);
    if (j >= n) continue;
    T scale[kPack], shift[kPack];
    if (w) load_pack(w + j, scale);
    if (b) load_pack(b + j, shift);
#pragma unroll
    for (int e = 0; e < kPack; ++e) {
      v[p][e] = (v[p][e] - mu) * r;
      if (w) v[p][e] *= scale[e];
      if (b) v[p][e] += shift[e];
    }
    store_pack(out + row * n + j, v[p]);
  }
}

/// Writes the block's column sums of `sums` (this lane's columns, per warp) to out[0, n): the
/// warps' values go to shared memory, then each column adds them in warp order.
template <int kPacks, class T>
__device__ void fold_warps(const T (&sums)[kPacks][kPack], T* shared, T* out, int n) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int p = 0; p < kPacks; ++p) {
    const int j = pack_column(p, lane);
    if (j < n)
#pragma unroll
      for (int e = 0; e < kPack; ++e) shared[warp * n + j + e] = sums[p][e];
  }
  __syncthreads();
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    T total = 0;
    for (int k = 0; k < kWarpsPerBlock; ++k) total += shared[k * n + j];
    out[j] = total;
  }
  __syncthreads();  // shared is reused by the next fold
}

/// Blocks a multiprocessor runs of the packed backward: two keep enough loads in flight, and
/// the launch bound caps registers to fit them (rows of 1024 and float64 would spill: one).
template <int kPacks, class T>
constexpr int backward_blocks_per_sm() {
  return sizeof(T) == 8 || kPacks == kMaxPacksPerLane ? 1 : 2;
}

// A row's g (times the weight) and xhat stay in registers between its sums and dx. (Reading g
// and x again for dx instead, from the L1 cache, freed registers for a third block but measured
// 15% slower on an H200.)
template <class S, class W, int kPacks, class T = compute_t<S>>
__global__ void __launch_bounds__(kThreads, (backward_blocks_per_sm<kPacks, T>()))
    layer_norm_backward_packed_kernel(const S* __restrict__ g, const S* __restrict__ x,
                                      const W* __restrict__ w, const T* mean, const T* rstd, S* dx,
                                      T* dweight_part, T* dbias_part, int64_t rows, int n) {
  extern __shared__ unsigned char shared_bytes[];
  const int lane = threadIdx.x % 32;
  T dw[kPacks][kPack] = {}, db[kPacks][kPack] = {};
  for (int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; row < rows;
       row += int64_t(gridDim.x) * kWarpsPerBlock) {
    const T mu = mean ? mean[row] : T(0), r = rstd[row];
    T gw[kPacks][kPack], xhat[kPacks][kPack], sum_g = 0, sum_gx = 0;
#pragma unroll
    for (int p = 0; p < kPacks; ++p) {
      const int j = pack_column(p, lane);
      if (j >= n) continue;
      T scale[kPack];
      load_pack(g + row * n + j, gw[p]);
      load_pack(x + row * n + j, xhat[p]);
      if (w) load_pack(w + j, scale);
#pragma unroll
      for (int e = 0; e < kPack; ++e) {
        xhat[p][e] = (xhat[p][e] - mu) * r;
        dw[p][e] += gw[p][e] * xhat[p][e];
        db[p][e] += gw[p][e];
        if (w) gw[p][e] *= scale[e];
        sum_g += gw[p][e];
        sum_gx += gw[p][e] * xhat[p][e];
      }
    }
    if (!dx) continue;
    const T mean_g = mean ? warp_reduce(sum_g, Combine::Sum) / T(n) : T(0);
    const T mean_gx = warp_reduce(sum_gx, Combine::Sum) / T(n);
#pragma unroll
    for (int p = 0; p < kPacks; ++p) {
      const int j = pack_column(p, lane);
      if (j >= n) continue;
#pragma unroll
      for (int e = 0; e < kPack; ++e) gw[p][e] = r * (gw[p][e] - mean_g - xhat[p][e] * mean_gx);
      store_pack(dx + row * n + j, gw[p]);
    }
  }
  if (!dweight_part) return;  // the same for every thread of the block
  T* shared = reinterpret_cast<T*>(shared_bytes);
  fold_warps(dw, shared, dweight_part + int64_t(blockIdx.x) * n, n);
  fold_warps(db, shared, dbias_part + int64_t(blockIdx.x) * n, n);
}

// Rows the packed kernels do not take: a block per row.
template <class S, class W, class T = compute_t<S>>
__global__ void layer_norm_kernel(const S* x, const W* w, const W* b, T eps, bool rms, S* out,
                                  T* mean, T* rstd, int64_t n) {
  const S* xi = x + blockIdx.x * n;
  T mu = 0;
  if (!rms) {
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) mu += T(xi[j]);
    mu = block_reduce(mu, Combine::Sum) / T(n);
  }
  T squares = 0;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
    squares += (T(xi[j]) - mu) * (T(xi[j]) - mu);
  const T r = T(1) / sqrt(block_reduce(squares, Combine::Sum) / T(n) + eps);
  if (threadIdx.x == 0) {
    if (mean) mean[blockIdx.x] = mu;
    rstd[blockIdx.x] = r;
  }
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    T v = (T(xi[j]) - mu) * r;
    if (w) v *= T(w[j]);
    if (b) v += T(b[j]);
    out[blockIdx.x * n + j] = S(v);
  }
}

// dx per row (one block per row); dweight/dbias by a second kernel over columns.
template <class S, class W, class T = compute_t<S>>
__global__ void layer_norm_dx_kernel(const S* g, const S* x, const W* w, const T* mean,
                                     const T* rstd, S* dx, int64_t n) {
  const int64_t base = blockIdx.x * n;
  const T mu = mean ? mean[blockIdx.x] : T(0), r = rstd[blockIdx.x];
  T sum_g = 0, sum_gx = 0;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    const T gw = w ? T(g[base + j]) * T(w[j]) : T(g[base + j]);
    sum_g += gw;
    sum_gx += gw * (T(x[base + j]) - mu) * r;
  }
  sum_g = block_reduce(sum_g, Combine::Sum);
  sum_gx = block_reduce(sum_gx, Combine::Sum);
  const T mean_g = mean ? sum_g / T(n) : T(0), mean_gx = sum_gx / T(n);
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    const T gw = w ? T(g[base + j]) * T(w[j]) : T(g[base + j]);
    dx[base + j] = S(r * (gw - mean_g - (T(x[base + j]) - mu) * r * mean_gx));
  }
}

// dweight and dbias as column sums over rows: block (x, y) sums 32 columns over row chunk y,
// 8 rows at a time (reads coalesced along the row), into partials [chunks, n] that
// column_sums_kernel adds up.
constexpr int kParamColumns = 32, kParamRowGroups = 8;

template <class S, class T = compute_t<S>>
__global__ void layer_norm_params_kernel(const S* g, const S* x, const T* mean, const T* rstd,
                                         T* dweight_part, T* dbias_part, int64_t rows, int64_t n,
                                         int64_t chunk) {
  __shared__ T dw_s[kParamRowGroups][kParamColumns], db_s[kParamRowGroups][kParamColumns];
  const int tx = threadIdx.x % kParamColumns, ty = threadIdx.x / kParamColumns;
  const int64_t j = int64_t(blockIdx.x) * kParamColumns + tx;
  const int64_t begin = int64_t(blockIdx.y) * chunk, end = min(rows, begin + chunk);
  T dw = 0, db = 0;
  if (j < n)
    for (int64_t i = begin + ty; i < end; i += kParamRowGroups) {
      const T gi = T(g[i * n + j]);
      dw += gi * (T(x[i * n + j]) - (mean ? mean[i] : T(0))) * rstd[i];
      db += gi;
    }
  dw_s[ty][tx] = dw;
  db_s[ty][tx] = db;
  __syncthreads();
  if (ty == 0 && j < n) {
    for (int r = 1; r < kParamRowGroups; ++r) {
      dw += dw_s[r][tx];
      db += db_s[r][tx];
    }
    dweight_part[blockIdx.y * n + j] = dw;
    dbias_part[blockIdx.y * n + j] = db;
  }
}

// dweight and dbias from the partial sums [chunks, n]: block x takes 32 columns, its 32 warps
// chunks c = warp, warp + 32, ... (a warp reads 32 adjacent columns), then the warps' sums are
// added in warp order: a fixed order, so the same bits each run. One thread a column, looping
// over every chunk, waited on its loads one after another (60 µs for 264 chunks of 768).
constexpr int kSumColumns = 32, kSumGroups = 32;

template <class T, class W>
__global__ void __launch_bounds__(kSumColumns* kSumGroups)
    column_sums_kernel(const T* dweight_part, const T* dbias_part, int64_t chunks, int64_t n,
                       W* dweight, W* dbias) {
  __shared__ T dw_s[kSumGroups][kSumColumns + 1], db_s[kSumGroups][kSumColumns + 1];
  const int tx = threadIdx.x % kSumColumns, ty = threadIdx.x / kSumColumns;
  const int64_t j = int64_t(blockIdx.x) * kSumColumns + tx;
  T dw = 0, db = 0;
  if (j < n)
    for (int64_t c = ty; c < chunks; c += kSumGroups) {
      dw += dweight_part[c * n + j];
      db += dbias_part[c * n + j];
    }
  dw_s[ty][tx] = dw;
  db_s[ty][tx] = db;
  __syncthreads();
  if (ty != 0 || j >= n) return;
  for (int k = 1; k < kSumGroups; ++k) {
    dw += dw_s[k][tx];
    db += db_s[k][tx];
  }
  if (dweight) dweight[j] = W(dw);
  if (dbias) dbias[j] = W(db);
}

/// Whether the packed kernels take rows of n: a multiple of kPack up to kMaxPackedRow, every
/// pointer on a 16-byte boundary (rows then stay on one, n * sizeof(S) being a multiple of 16),
/// and a block's column sums of T in shared memory.
bool packed_rows(int64_t n, size_t compute_size, std::initializer_list<const Tensor*> tensors) {
  if (n <= 0 || n % kPack != 0 || n > kMaxPackedRow) return false;
  if (size_t(kWarpsPerBlock) * size_t(n) * compute_size > kMaxSharedBytes) return false;
  for (const Tensor* t : tensors)
    if (t->defined() && reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 != 0) return false;
  return true;
}

/// Calls fn(std::integral_constant<int, P>{}) with the packs per lane that a row of n takes.
template <class Fn>
void with_packs(int64_t n, Fn&& fn) {
  switch ((n + 32 * kPack - 1) / (32 * kPack)) {
    case 1:
      return fn(std::integral_constant<int, 1>{});
    case 2:
      return fn(std::integral_constant<int, 2>{});
    case 3:
      return fn(std::integral_constant<int, 3>{});
    default:
      return fn(std::integral_constant<int, kMaxPacksPerLane>{});
  }
}

/// Calls fn(type_tag<W>{}) for the dtype of the weight, bias and their gradients (those
/// defined, which share it): the rows' 16-bit S, or T = compute_t<S>.
template <class S, class Fn>
void with_param_type(std::initializer_list<const Tensor*> params, Fn&& fn) {
  using T = compute_t<S>;
  const Tensor* first = nullptr;
  for (const Tensor* t : params) {
    if (!t->defined()) continue;
    if (!first) first = t;
    WEAVE_CHECK(t->dtype() == first->dtype(), "layer_norm",
                "expected the weight, bias and their gradients in one dtype, found {} and {}",
                first->dtype(), t->dtype());
  }
  if constexpr (!std::is_same_v<S, T>)
    if (first && first->dtype() == dtype_of<S>::value) return fn(type_tag<S>{});
  WEAVE_CHECK(!first || first->dtype() == dtype_of<T>::value, "layer_norm",
              "expected the weight in {} or {}, found {}", dtype_of<S>::value, dtype_of<T>::value,
              first ? first->dtype() : dtype_of<T>::value);
  fn(type_tag<T>{});
}

/// dweight and dbias (either may be undefined) from partial column sums parts[2][chunks][n].
template <class T, class W>
void add_partial_sums(const Tensor& parts, int64_t chunks, int64_t n, const Tensor& dweight,
                      const Tensor& dbias, cudaStream_t s) {
  const T* dw_part = static_cast<const T*>(parts.data_ptr());
  column_sums_kernel<T, W><<<blocks_for(n, kSumColumns), kSumColumns * kSumGroups, 0, s>>>(
      dw_part, dw_part + chunks * n, chunks, n, maybe_mut<W>(dweight), maybe_mut<W>(dbias));
  check_launch("layer_norm");
}

}  // namespace

void layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps, bool rms,
                const Tensor& out, const Tensor& mean, const Tensor& rstd) {
  const int64_t n = x.size(-1), rows = rows_of(x, n);
  if (rows == 0) return;
  DeviceGuard guard(x.device().index);
  cudaStream_t s = weave::cuda::stream(x.device().index);
  visit_param_dtype(x.dtype(), "layer_norm", [&](auto tag) {
    using S = typename decltype(tag)::type;
    using T = compute_t<S>;
    with_param_type<S>({&weight, &bias}, [&](auto param_tag) {
      using W = typename decltype(param_tag)::type;
      if (packed_rows(n, sizeof(T), {&x, &weight, &bias, &out})) {
        with_packs(n, [&](auto packs) {
          layer_norm_packed_kernel<S, W, decltype(packs)::value>
              <<<blocks_for(rows, kWarpsPerBlock), kThreads, 0, s>>>(
                  maybe<S>(x), maybe<W>(weight), maybe<W>(bias), T(eps), rms, maybe_mut<S>(out),
                  maybe_mut<T>(mean), maybe_mut<T>(rstd), rows, int(n));
        });
        check_launch("layer_norm");
        return;
      }
      per_row(x, rows, "layer_norm", [&](unsigned blocks, cudaStream_t st) {
        layer_norm_kernel<S, W><<<blocks, kThreads, 0, st>>>(
            maybe<S>(x), maybe<W>(weight), maybe<W>(bias), T(eps), rms, maybe_mut<S>(out),
            maybe_mut<T>(mean), maybe_mut<T>(rstd), n);
      });
    });
  });
}

namespace {

/// The packed backward: dx and the blocks' partial column sums in one pass, then their sums.
template <class S, class W, class T = compute_t<S>>
void packed_backward(const Tensor& grad, const Tensor& x, const Tensor& weight, const Tensor& mean,
                     const Tensor& rstd, const Tensor& dx, const Tensor& dweight,
                     const Tensor& dbias, int64_t rows, int64_t n, cudaStream_t s) {
  const bool params = dweight.defined() || dbias.defined();
  with_packs(n, [&](auto packs) {
    constexpr int kPacks = decltype(packs)::value;
    // Enough warps to keep loads in flight, few enough that the partial sums stay small.
    const int64_t sms = weave::cuda::device_properties(x.device().index).multiProcessorCount;
    const int64_t blocks = std::min<int64_t>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock,
                                             backward_blocks_per_sm<kPacks, T>() * sms);
    Tensor parts = params
                       ? empty({2, blocks, n}, {.dtype = dtype_of<T>::value, .device = x.device()})
                       : Tensor();
    T* dw_part = maybe_mut<T>(parts);
    layer_norm_backward_packed_kernel<S, W, kPacks>
        <<<unsigned(blocks), kThreads, params ? kWarpsPerBlock * n * sizeof(T) : 0, s>>>(
            maybe<S>(grad), maybe<S>(x), maybe<W>(weight), maybe<T>(mean), maybe<T>(rstd),
            maybe_mut<S>(dx), dw_part, params ? dw_part + blocks * n : nullptr, rows, int(n));
    check_launch("layer_norm");
    if (params) add_partial_sums<T, W>(parts, blocks, n, dweight, dbias, s);
  });
}

/// The block-per-row backward: dx, then the parameter gradients over row chunks.
template <class S, class W, class T = compute_t<S>>
void row_backward(const Tensor& grad, const Tensor& x, const Tensor& weight, const Tensor& mean,
                  const Tensor& rstd, const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                  int64_t rows, int64_t n, cudaStream_t s) {
  if (dx.defined())
    per_row(x, rows, "layer_norm", [&](unsigned r, cudaStream_t st) {
      layer_norm_dx_kernel<S, W><<<r, kThreads, 0, st>>>(maybe<S>(grad), maybe<S>(x),
                                                         maybe<W>(weight), maybe<T>(mean),
                                                         maybe<T>(rstd), maybe_mut<S>(dx), n);
    });
  if (!dweight.defined() && !dbias.defined()) return;
  // About 256 rows a block, at most 1024 chunks: enough blocks for any n.
  const int64_t chunks = std::min<int64_t>(1024, (rows + 255) / 256);
  const int64_t chunk = (rows + chunks - 1) / chunks;
  Tensor parts = empty({2, chunks, n}, {.dtype = dtype_of<T>::value, .device = x.device()});
  T* dw_part = maybe_mut<T>(parts);
  const dim3 grid(unsigned((n + kParamColumns - 1) / kParamColumns), unsigned(chunks));
  layer_norm_params_kernel<S><<<grid, kParamColumns * kParamRowGroups, 0, s>>>(
      maybe<S>(grad), maybe<S>(x), maybe<T>(mean), maybe<T>(rstd), dw_part, dw_part + chunks * n,
      rows, n, chunk);
  check_launch("layer_norm");
  add_partial_sums<T, W>(parts, chunks, n, dweight, dbias, s);
}

}  // namespace

void layer_norm_backward(const Tensor& grad, const Tensor& x, const Tensor& weight,
                         const Tensor& mean, const Tensor& rstd, bool, const Tensor& dx,
                         const Tensor& dweight, const Tensor& dbias) {
  const int64_t n = x.size(-1), rows = rows_of(x, n);
  if (rows == 0 || n == 0) {  // no rows: nothing flows to x, and the sums are zero
    for (Tensor sums : {dweight, dbias})
      if (sums.defined()) sums.zero_();
    return;
  }
  DeviceGuard guard(x.device().index);
  cudaStream_t s = weave::cuda::stream(x.device().index);
  visit_param_dtype(x.dtype(), "layer_norm", [&](auto tag) {
    using S = typename decltype(tag)::type;
    using T = compute_t<S>;
    with_param_type<S>({&weight, &dweight, &dbias}, [&](auto param_tag) {
      using W = typename decltype(param_tag)::type;
      if (packed_rows(n, sizeof(T), {&grad, &x, &weight, &dx}))
        packed_backward<S, W>(grad, x, weight, mean, rstd, dx, dweight, dbias, rows, n, s);
      else
        row_backward<S, W>(grad, x, weight, mean, rstd, dx, dweight, dbias, rows, n, s);
    });
  });
}

}  // namespace weave::kernels::cuda
