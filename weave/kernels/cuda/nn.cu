// CUDA kernels of the fused neural-network ops: one block per row for softmax, cross-entropy and
// blocked attention's softmax, the row's sums combined by warp shuffles, then across warps in
// shared memory (layer and RMS norm: layer_norm.cu; bias + activation lives with the elementwise
// launcher, in elementwise.cu).
#include <cuda_runtime.h>

#include <cmath>

#include "weave/kernels/backends.h"
#include "weave/kernels/cuda/rows.cuh"

namespace weave::kernels::cuda {

namespace {

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
template <class T>
__global__ void attention_softmax_kernel(T* s, T* lse, functors::KeyRange range, T scale, T cap) {
  const int64_t tk = range.tk;
  T* row = s + int64_t(blockIdx.x) * tk;
  const int64_t i = blockIdx.x % range.tq, begin = range.begin(i), end = range.end(i);
  for (int64_t j = threadIdx.x; j < tk; j += blockDim.x)
    row[j] = functors::softcap(row[j] * scale, cap);
  T m = -INFINITY;
  for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) m = max(m, row[j]);
  m = block_reduce(m, Combine::Max);
  T sum = 0;
  for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) sum += exp(row[j] - m);
  sum = block_reduce(sum, Combine::Sum);
  const T inverse = T(1) / sum;
  for (int64_t j = threadIdx.x; j < tk; j += blockDim.x)
    row[j] = j >= begin && j < end ? exp(row[j] - m) * inverse : T(0);
  if (threadIdx.x == 0) lse[blockIdx.x] = m + log(sum);
}

template <class T>
__global__ void attention_probs_kernel(T* s, const T* lse, T* capped, int64_t n,
                                       functors::KeyRange range, T scale, T cap) {
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e / range.tk, j = e % range.tk;
    const T value = functors::softcap(s[e] * scale, cap);
    if (capped) capped[e] = value;
    s[e] = range.sees(r % range.tq, j) ? exp(value - lse[r]) : T(0);
  }
}

template <class T>
__global__ void attention_score_grad_kernel(T* dp, const T* p, const T* delta, const T* capped,
                                            int64_t n, int64_t tk, T scale, T cap) {
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += int64_t(gridDim.x) * blockDim.x) {
    const T through_cap = capped ? functors::softcap_grad(capped[e], cap) : T(1);
    dp[e] = scale * p[e] * (dp[e] - delta[e / tk]) * through_cap;
  }
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

void attention_softmax(const Tensor& s, const AttentionParams& params, const Tensor& lse) {
  const functors::KeyRange range = key_range(params, s.size(1), s.size(2));
  visit_floating(s.dtype(), "attention_softmax", [&](auto tag) {
    using T = typename decltype(tag)::type;
    per_row(s, rows_of(s, range.tk), "attention_softmax", [&](unsigned rows, cudaStream_t st) {
      attention_softmax_kernel<T><<<rows, kThreads, 0, st>>>(
          maybe_mut<T>(s), maybe_mut<T>(lse), range, T(params.scale), T(params.softcap));
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

void attention_probs(const Tensor& s, const AttentionParams& params, const Tensor& lse,
                     const Tensor& capped) {
  const functors::KeyRange range = key_range(params, s.size(1), s.size(2));
  over_elements(s, "attention_probs", [&](auto tag, unsigned blocks, cudaStream_t st) {
    using T = typename decltype(tag)::type;
    attention_probs_kernel<T><<<blocks, kThreads, 0, st>>>(maybe_mut<T>(s), maybe<T>(lse),
                                                           maybe_mut<T>(capped), s.numel(), range,
                                                           T(params.scale), T(params.softcap));
  });
}

void attention_score_grad(const Tensor& dp, const Tensor& p, const Tensor& delta, double scale,
                          const Tensor& capped, double softcap) {
  over_elements(dp, "attention_score_grad", [&](auto tag, unsigned blocks, cudaStream_t st) {
    using T = typename decltype(tag)::type;
    attention_score_grad_kernel<T><<<blocks, kThreads, 0, st>>>(
        maybe_mut<T>(dp), maybe<T>(p), maybe<T>(delta), maybe<T>(capped), dp.numel(), dp.size(2),
        T(scale), T(softcap));
  });
}

}  // namespace weave::kernels::cuda
