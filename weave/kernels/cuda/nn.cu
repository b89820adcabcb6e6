// CUDA kernels of the fused neural-network ops: one block per row for softmax, layer/RMS norm
// and cross-entropy, the row's sums combined by warp shuffles, then across warps in shared
// memory; layer norm of rows up to 1024 wide takes a warp per row, the row in registers (bias +
// activation lives with the elementwise launcher, in elementwise.cu).
#include <cuda_runtime.h>

#include <cmath>

#include "weave/kernels/backends.h"
#include "weave/tensor/cuda/common.cuh"

namespace weave::kernels::cuda {

namespace {

enum class Combine { Sum, Max };

template <class T>
__device__ inline T combine(T a, T b, Combine how) {
  return how == Combine::Sum ? a + b : (b > a || b != b ? b : a);  // a NaN wins the max
}

/// Combines one value per lane across the warp (a butterfly: every lane gets the same result,
/// since each pairing is symmetric).
template <class T>
__device__ T warp_reduce(T value, Combine how) {
  for (int step = 16; step > 0; step /= 2)
    value = combine(value, __shfl_xor_sync(0xffffffffu, value, step), how);
  return value;
}

/// Combines one value per thread across the block; every thread gets the result. The warps
/// reduce by shuffles, then every thread folds the warps' results in order.
template <class T>
__device__ T block_reduce(T value, Combine how) {
  __shared__ T warps[32];
  value = warp_reduce(value, how);
  if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = value;
  __syncthreads();
  T result = warps[0];
  for (int w = 1; w < int(blockDim.x / 32); ++w) result = combine(result, warps[w], how);
  __syncthreads();  // warps is reused by the next call
  return result;
}

template <class T>
__device__ T row_max(const T* x, int64_t n) {
  T m = -INFINITY;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) m = x[j] > m || x[j] != x[j] ? x[j] : m;
  return block_reduce(m, Combine::Max);
}

template <class T>
__device__ T safe_shift(T m) {
  return isinf(m) ? T(0) : m;
}

template <class T>
__global__ void softmax_kernel(const T* x, T* out, int64_t n, bool log) {
  const T* xi = x + blockIdx.x * n;
  T* oi = out + blockIdx.x * n;
  const T shift = safe_shift(row_max(xi, n));
  T sum = 0;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) sum += exp(xi[j] - shift);
  sum = block_reduce(sum, Combine::Sum);
  const T offset = shift + ::log(sum);
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
    oi[j] = log ? xi[j] - offset : exp(xi[j] - offset);
}

template <class T>
__global__ void softmax_backward_kernel(const T* g, const T* y, T* out, int64_t n, bool log) {
  const int64_t base = blockIdx.x * n;
  T total = 0;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
    total += log ? g[base + j] : g[base + j] * y[base + j];
  total = block_reduce(total, Combine::Sum);
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
    out[base + j] =
        log ? g[base + j] - exp(y[base + j]) * total : y[base + j] * (g[base + j] - total);
}

// The normalizations read and write rows in their storage type S (bfloat16 and float16 as they
// are) and compute, keep statistics and take weights in T = compute_t<S>.
template <class S, class T = compute_t<S>>
__global__ void layer_norm_kernel(const S* x, const T* w, const T* b, T eps, bool rms, S* out,
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
    if (w) v *= w[j];
    if (b) v += b[j];
    out[blockIdx.x * n + j] = S(v);
  }
}

// Rows of at most kWarpRow elements: a warp per row, the row held in registers (one read of x,
// shuffles only), kRowsPerBlock rows a block.
constexpr int kWarpRow = 1024, kRowsPerBlock = kThreads / 32;

template <class S, class T = compute_t<S>>
__global__ void layer_norm_warp_kernel(const S* x, const T* w, const T* b, T eps, bool rms, S* out,
                                       T* mean, T* rstd, int64_t rows, int n) {
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;  // the whole warp
  const int lane = threadIdx.x % 32;
  const S* xi = x + row * n;
  T v[kWarpRow / 32], sum = 0;
#pragma unroll
  for (int k = 0; k < kWarpRow / 32; ++k) {
    const int j = lane + 32 * k;
    v[k] = j < n ? T(xi[j]) : T(0);
    sum += v[k];
  }
  const T mu = rms ? T(0) : warp_reduce(sum, Combine::Sum) / T(n);
  T squares = 0;
#pragma unroll
  for (int k = 0; k < kWarpRow / 32; ++k)
    if (lane + 32 * k < n) squares += (v[k] - mu) * (v[k] - mu);
  const T r = T(1) / sqrt(warp_reduce(squares, Combine::Sum) / T(n) + eps);
  if (lane == 0) {
    if (mean) mean[row] = mu;
    rstd[row] = r;
  }
#pragma unroll
  for (int k = 0; k < kWarpRow / 32; ++k) {
    const int j = lane + 32 * k;
    if (j >= n) continue;
    T o = (v[k] - mu) * r;
    if (w) o *= w[j];
    if (b) o += b[j];
    out[row * n + j] = S(o);
  }
}

template <class S, class T = compute_t<S>>
__global__ void layer_norm_dx_warp_kernel(const S* g, const S* x, const T* w, const T* mean,
                                          const T* rstd, S* dx, int64_t rows, int n) {
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;  // the whole warp
  const int lane = threadIdx.x % 32;
  const int64_t base = row * n;
  const T mu = mean ? mean[row] : T(0), r = rstd[row];
  T gw[kWarpRow / 32], xhat[kWarpRow / 32], sum_g = 0, sum_gx = 0;
#pragma unroll
  for (int k = 0; k < kWarpRow / 32; ++k) {
    const int j = lane + 32 * k;
    const bool in = j < n;
    gw[k] = in ? (w ? T(g[base + j]) * w[j] : T(g[base + j])) : T(0);
    xhat[k] = in ? (T(x[base + j]) - mu) * r : T(0);
    sum_g += gw[k];
    sum_gx += gw[k] * xhat[k];
  }
  sum_g = warp_reduce(sum_g, Combine::Sum);
  sum_gx = warp_reduce(sum_gx, Combine::Sum);
  const T mean_g = mean ? sum_g / T(n) : T(0), mean_gx = sum_gx / T(n);
#pragma unroll
  for (int k = 0; k < kWarpRow / 32; ++k) {
    const int j = lane + 32 * k;
    if (j < n) dx[base + j] = S(r * (gw[k] - mean_g - xhat[k] * mean_gx));
  }
}

// dx per row (one block per row); dweight/dbias by a second kernel over columns.
template <class S, class T = compute_t<S>>
__global__ void layer_norm_dx_kernel(const S* g, const S* x, const T* w, const T* mean,
                                     const T* rstd, S* dx, int64_t n) {
  const int64_t base = blockIdx.x * n;
  const T mu = mean ? mean[blockIdx.x] : T(0), r = rstd[blockIdx.x];
  T sum_g = 0, sum_gx = 0;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    const T gw = w ? T(g[base + j]) * w[j] : T(g[base + j]);
    sum_g += gw;
    sum_gx += gw * (T(x[base + j]) - mu) * r;
  }
  sum_g = block_reduce(sum_g, Combine::Sum);
  sum_gx = block_reduce(sum_gx, Combine::Sum);
  const T mean_g = mean ? sum_g / T(n) : T(0), mean_gx = sum_gx / T(n);
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    const T gw = w ? T(g[base + j]) * w[j] : T(g[base + j]);
    dx[base + j] = S(r * (gw - mean_g - (T(x[base + j]) - mu) * r * mean_gx));
  }
}

// dweight and dbias as column sums over rows: block (x, y) sums 32 columns over row chunk y,
// 8 rows at a time (reads coalesced along the row), into partials [chunks, n] that
// layer_norm_params_finish_kernel adds up per column in a fixed order (the same bits each run).
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

template <class T>
__global__ void layer_norm_params_finish_kernel(const T* dweight_part, const T* dbias_part,
                                                int64_t chunks, int64_t n, T* dweight, T* dbias) {
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= n) return;
  T dw = 0, db = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    dw += dweight_part[c * n + j];
    db += dbias_part[c * n + j];
  }
  if (dweight) dweight[j] = dw;
  if (dbias) dbias[j] = db;
}

template <class T>
__global__ void cross_entropy_kernel(const T* logits, const int64_t* target, int64_t ignore,
                                     T* loss, T* lse, int64_t n) {
  const T* xi = logits + blockIdx.x * n;
  const T shift = safe_shift(row_max(xi, n));
  T sum = 0;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) sum += exp(xi[j] - shift);
  sum = block_reduce(sum, Combine::Sum);
  if (threadIdx.x == 0) {
    const T e = shift + ::log(sum);
    const int64_t t = target[blockIdx.x];
    lse[blockIdx.x] = e;
    loss[blockIdx.x] = t == ignore ? T(0) : e - xi[t];
  }
}

template <class T>
__global__ void cross_entropy_backward_kernel(const T* grad, int64_t grad_stride, const T* logits,
                                              const int64_t* target, int64_t ignore, const T* lse,
                                              T* dlogits, int64_t n) {
  const int64_t row = blockIdx.x, t = target[row];
  const T g = t == ignore ? T(0) : grad[row * grad_stride], e = lse[row];
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
    dlogits[row * n + j] = g * (exp(logits[row * n + j] - e) - (j == t ? T(1) : T(0)));
}

// Blocked attention's row passes (kernels.h): a block per row of scores for the softmax, a
// grid-stride pass for the elementwise ones.
__device__ inline int64_t seen_keys(int64_t i, int64_t tq, int64_t tk, bool causal) {
  return causal ? min(max(i + 1 + tk - tq, int64_t(0)), tk) : tk;
}

template <class T>
__global__ void attention_softmax_kernel(T* s, T* lse, int64_t tq, int64_t tk, T scale,
                                         bool causal) {
  T* row = s + int64_t(blockIdx.x) * tk;
  const int64_t end = seen_keys(blockIdx.x % tq, tq, tk, causal);
  T m = -INFINITY;
  for (int64_t j = threadIdx.x; j < end; j += blockDim.x) m = max(m, row[j] * scale);
  m = block_reduce(m, Combine::Max);
  T sum = 0;
  for (int64_t j = threadIdx.x; j < end; j += blockDim.x) sum += exp(row[j] * scale - m);
  sum = block_reduce(sum, Combine::Sum);
  const T inverse = T(1) / sum;
  for (int64_t j = threadIdx.x; j < tk; j += blockDim.x)
    row[j] = j < end ? exp(row[j] * scale - m) * inverse : T(0);
  if (threadIdx.x == 0) lse[blockIdx.x] = m + log(sum);
}

template <class T>
__global__ void attention_probs_kernel(T* s, const T* lse, int64_t n, int64_t tq, int64_t tk,
                                       T scale, bool causal) {
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e / tk, j = e % tk;
    s[e] = j < seen_keys(r % tq, tq, tk, causal) ? exp(s[e] * scale - lse[r]) : T(0);
  }
}

template <class T>
__global__ void attention_score_grad_kernel(T* dp, const T* p, const T* delta, int64_t n,
                                            int64_t tk, T scale) {
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += int64_t(gridDim.x) * blockDim.x)
    dp[e] = scale * p[e] * (dp[e] - delta[e / tk]);
}

int64_t rows_of(const Tensor& t, int64_t n) {
  return n == 0 ? 0 : t.numel() / n;
}

/// Launches one block per row on t's device stream (nothing for no rows).
template <class Launch>
void per_row(const Tensor& t, int64_t rows, const char* op, const Launch& launch) {
  if (rows == 0) return;
  WEAVE_CHECK(rows <= 0x7fffffff, op, "too many rows ({}) for one launch", rows);
  DeviceGuard guard(t.device().index);
  launch(static_cast<unsigned>(rows), weave::cuda::stream(t.device().index));
  check_launch(op);
}

template <class T>
const T* maybe(const Tensor& t) {
  return t.defined() ? static_cast<const T*>(t.data_ptr()) : nullptr;
}
template <class T>
T* maybe_mut(const Tensor& t) {
  return t.defined() ? static_cast<T*>(t.data_ptr()) : nullptr;
}

}  // namespace

void softmax(const Tensor& x, const Tensor& out, bool log) {
  const int64_t n = x.dim() == 0 ? 1 : x.size(-1);
  visit_floating(x.dtype(), "softmax", [&](auto tag) {
    using T = typename decltype(tag)::type;
    per_row(x, rows_of(x, n), "softmax", [&](unsigned rows, cudaStream_t s) {
      softmax_kernel<T><<<rows, kThreads, 0, s>>>(maybe<T>(x), maybe_mut<T>(out), n, log);
    });
  });
}

void softmax_backward(const Tensor& grad, const Tensor& y, const Tensor& out, bool log) {
  const int64_t n = y.dim() == 0 ? 1 : y.size(-1);
  visit_floating(y.dtype(), "softmax", [&](auto tag) {
    using T = typename decltype(tag)::type;
    per_row(y, rows_of(y, n), "softmax", [&](unsigned rows, cudaStream_t s) {
      softmax_backward_kernel<T>
          <<<rows, kThreads, 0, s>>>(maybe<T>(grad), maybe<T>(y), maybe_mut<T>(out), n, log);
    });
  });
}

void layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps, bool rms,
                const Tensor& out, const Tensor& mean, const Tensor& rstd) {
  const int64_t n = x.size(-1);
  visit_param_dtype(x.dtype(), "layer_norm", [&](auto tag) {
    using S = typename decltype(tag)::type;
    using T = compute_t<S>;
    const int64_t rows = rows_of(x, n);
    if (n <= kWarpRow && rows > 0) {
      DeviceGuard guard(x.device().index);
      layer_norm_warp_kernel<S>
          <<<blocks_for(rows, kRowsPerBlock), kThreads, 0, weave::cuda::stream(x.device().index)>>>(
              maybe<S>(x), maybe<T>(weight), maybe<T>(bias), T(eps), rms, maybe_mut<S>(out),
              maybe_mut<T>(mean), maybe_mut<T>(rstd), rows, int(n));
      check_launch("layer_norm");
      return;
    }
    per_row(x, rows, "layer_norm", [&](unsigned blocks, cudaStream_t s) {
      layer_norm_kernel<S><<<blocks, kThreads, 0, s>>>(
          maybe<S>(x), maybe<T>(weight), maybe<T>(bias), T(eps), rms, maybe_mut<S>(out),
          maybe_mut<T>(mean), maybe_mut<T>(rstd), n);
    });
  });
}

void layer_norm_backward(const Tensor& grad, const Tensor& x, const Tensor& weight,
                         const Tensor& mean, const Tensor& rstd, bool, const Tensor& dx,
                         const Tensor& dweight, const Tensor& dbias) {
  const int64_t n = x.size(-1), rows = rows_of(x, n);
  visit_param_dtype(x.dtype(), "layer_norm", [&](auto tag) {
    using S = typename decltype(tag)::type;
    using T = compute_t<S>;
    if (dx.defined() && n <= kWarpRow && rows > 0) {
      DeviceGuard guard(x.device().index);
      layer_norm_dx_warp_kernel<S>
          <<<blocks_for(rows, kRowsPerBlock), kThreads, 0, weave::cuda::stream(x.device().index)>>>(
              maybe<S>(grad), maybe<S>(x), maybe<T>(weight), maybe<T>(mean), maybe<T>(rstd),
              maybe_mut<S>(dx), rows, int(n));
      check_launch("layer_norm");
    } else if (dx.defined()) {
      per_row(x, rows, "layer_norm", [&](unsigned r, cudaStream_t s) {
        layer_norm_dx_kernel<S><<<r, kThreads, 0, s>>>(maybe<S>(grad), maybe<S>(x),
                                                       maybe<T>(weight), maybe<T>(mean),
                                                       maybe<T>(rstd), maybe_mut<S>(dx), n);
      });
    }
    if ((dweight.defined() || dbias.defined()) && n > 0 && rows > 0) {
      DeviceGuard guard(x.device().index);
      cudaStream_t s = weave::cuda::stream(x.device().index);
      // About 256 rows a block, at most 1024 chunks: enough blocks for any n.
      const int64_t chunks = std::min<int64_t>(1024, (rows + 255) / 256);
      const int64_t chunk = (rows + chunks - 1) / chunks;
      Tensor parts = empty({2, chunks, n}, {.dtype = rstd.dtype(), .device = x.device()});
      T* dw_part = static_cast<T*>(parts.data_ptr());
      T* db_part = dw_part + chunks * n;
      const dim3 grid(unsigned((n + kParamColumns - 1) / kParamColumns), unsigned(chunks));
      layer_norm_params_kernel<S><<<grid, kParamColumns * kParamRowGroups, 0, s>>>(
          maybe<S>(grad), maybe<S>(x), maybe<T>(mean), maybe<T>(rstd), dw_part, db_part, rows, n,
          chunk);
      check_launch("layer_norm");
      layer_norm_params_finish_kernel<T><<<blocks_for(n, kThreads), kThreads, 0, s>>>(
          dw_part, db_part, chunks, n, maybe_mut<T>(dweight), maybe_mut<T>(dbias));
      check_launch("layer_norm");
    }
  });
}

void cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index,
                   const Tensor& loss, const Tensor& lse) {
  const int64_t n = logits.size(-1);
  visit_floating(logits.dtype(), "cross_entropy", [&](auto tag) {
    using T = typename decltype(tag)::type;
    per_row(logits, rows_of(logits, n), "cross_entropy", [&](unsigned rows, cudaStream_t s) {
      cross_entropy_kernel<T><<<rows, kThreads, 0, s>>>(maybe<T>(logits), maybe<int64_t>(target),
                                                        ignore_index, maybe_mut<T>(loss),
                                                        maybe_mut<T>(lse), n);
    });
  });
}

void cross_entropy_backward(const Tensor& grad, const Tensor& logits, const Tensor& target,
                            int64_t ignore_index, const Tensor& lse, const Tensor& dlogits) {
  const int64_t n = logits.size(-1);
  visit_floating(logits.dtype(), "cross_entropy", [&](auto tag) {
    using T = typename decltype(tag)::type;
    per_row(logits, rows_of(logits, n), "cross_entropy", [&](unsigned rows, cudaStream_t s) {
      cross_entropy_backward_kernel<T><<<rows, kThreads, 0, s>>>(
          maybe<T>(grad), grad.numel() == 1 ? 0 : 1, maybe<T>(logits), maybe<int64_t>(target),
          ignore_index, maybe<T>(lse), maybe_mut<T>(dlogits), n);
    });
  });
}

void attention_softmax(const Tensor& s, double scale, bool causal, const Tensor& lse) {
  const int64_t tq = s.size(1), tk = s.size(2);
  visit_floating(s.dtype(), "attention_softmax", [&](auto tag) {
    using T = typename decltype(tag)::type;
    per_row(s, rows_of(s, tk), "attention_softmax", [&](unsigned rows, cudaStream_t st) {
      attention_softmax_kernel<T>
          <<<rows, kThreads, 0, st>>>(maybe_mut<T>(s), maybe_mut<T>(lse), tq, tk, T(scale), causal);
    });
  });
}

namespace {
/// Runs launch(type_tag, blocks, stream) for t's floating dtype, a grid-stride pass over its
/// elements on its device (nothing for none).
template <class Launch>
void over_elements(const Tensor& t, const char* op, const Launch& launch) {
  if (t.numel() == 0) return;
  DeviceGuard guard(t.device().index);
  visit_floating(t.dtype(), op, [&](auto tag) {
    launch(tag, grid_stride_blocks(t.numel()), weave::cuda::stream(t.device().index));
  });
  check_launch(op);
}
}  // namespace

void attention_probs(const Tensor& s, double scale, bool causal, const Tensor& lse) {
  over_elements(s, "attention_probs", [&](auto tag, unsigned blocks, cudaStream_t st) {
    using T = typename decltype(tag)::type;
    attention_probs_kernel<T><<<blocks, kThreads, 0, st>>>(
        maybe_mut<T>(s), maybe<T>(lse), s.numel(), s.size(1), s.size(2), T(scale), causal);
  });
}

void attention_score_grad(const Tensor& dp, const Tensor& p, const Tensor& delta, double scale) {
  over_elements(dp, "attention_score_grad", [&](auto tag, unsigned blocks, cudaStream_t st) {
    using T = typename decltype(tag)::type;
    attention_score_grad_kernel<T><<<blocks, kThreads, 0, st>>>(
        maybe_mut<T>(dp), maybe<T>(p), maybe<T>(delta), dp.numel(), dp.size(2), T(scale));
  });
}

}  // namespace weave::kernels::cuda
