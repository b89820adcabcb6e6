// Kernels over many tensors per launch (gradient norms and scaling, the fused Adam step): a
// table of up to kListSize tensors travels in the launch's arguments, and each block finds its
// tensor and its kChunk elements from the table's running block counts. A model's hundreds of
// parameters then cost a handful of launches instead of several each.
#include <vector>

#include "weave/kernels/backends.h"
#include "weave/kernels/common/optim.h"
#include "weave/tensor/cuda/common.cuh"

namespace weave::kernels::cuda {

namespace {

constexpr int kListSize = 32;
constexpr int64_t kChunk = 8192;  // elements per block

template <int Arrays>
struct TensorList {
  void* data[Arrays][kListSize];
  int64_t numel[kListSize];
  int64_t first_block[kListSize + 1];
  double weight_decay[kListSize];
  int count;
};

/// The tensor a block works on and the range of it.
struct BlockRange {
  int tensor;
  int64_t begin, end;
};

template <int Arrays>
__device__ BlockRange block_range(const TensorList<Arrays>& list) {
  const int64_t b = blockIdx.x;
  int t = 0;
  while (t + 1 < list.count && list.first_block[t + 1] <= b) ++t;
  const int64_t begin = (b - list.first_block[t]) * kChunk;
  return {t, begin, min(list.numel[t], begin + kChunk)};
}

/// Splits `tensors` (rows of Arrays tensors each, the first giving the size) into launches of
/// at most kListSize tensors; launch(list, blocks, first_block_overall) runs each.
template <int Arrays, class Launch>
void for_each_list(const std::vector<std::array<Tensor, Arrays>>& tensors,
                   const std::vector<double>& weight_decay, Launch&& launch) {
  TensorList<Arrays> list{};
  int64_t blocks = 0, overall = 0;
  auto flush = [&] {
    if (list.count == 0) return;
    launch(list, blocks, overall);
    overall += blocks;
    list = {};
    blocks = 0;
  };
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t n = tensors[i][0].numel();
    if (n == 0) continue;
    for (int a = 0; a < Arrays; ++a) list.data[a][list.count] = tensors[i][a].data_ptr();
    list.numel[list.count] = n;
    list.first_block[list.count] = blocks;
    list.weight_decay[list.count] = weight_decay.empty() ? 0.0 : weight_decay[i];
    blocks += (n + kChunk - 1) / kChunk;
    list.first_block[++list.count] = blocks;
    if (list.count == kListSize) flush();
  }
  flush();
}

int64_t total_blocks(const std::vector<Tensor>& xs) {
  int64_t blocks = 0;
  for (const Tensor& x : xs) blocks += (x.numel() + kChunk - 1) / kChunk;
  return blocks;
}

enum class NormKind : int { SumSquares, SumAbs, SumPower, MaxAbs };

__device__ inline double fold(NormKind kind, double acc, double v, double p) {
  switch (kind) {
    case NormKind::SumSquares:
      return acc + v * v;
    case NormKind::SumAbs:
      return acc + v;
    case NormKind::SumPower:
      return acc + pow(v, p);
    case NormKind::MaxAbs:
      break;
  }
  return (acc != acc || v != v) ? NAN : max(acc, v);  // NaN wins, as the CPU's
}

__device__ inline double combine(NormKind kind, double a, double b) {
  if (kind != NormKind::MaxAbs) return a + b;
  return (a != a || b != b) ? NAN : max(a, b);
}

/// The block's threads fold their values in a fixed order; thread 0 returns the result.
__device__ double block_fold(NormKind kind, double acc) {
  __shared__ double warps[32];
  for (int step = 16; step > 0; step /= 2)
    acc = combine(kind, acc, __shfl_down_sync(0xffffffffu, acc, step));
  if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0)
    for (int w = 1; w < int(blockDim.x / 32); ++w) acc = combine(kind, acc, warps[w]);
  return acc;
}

template <class T>
__global__ void norm_parts_kernel(TensorList<1> list, NormKind kind, double p, double* parts) {
  const BlockRange r = block_range(list);
  const T* x = static_cast<const T*>(list.data[0][r.tensor]);
  double acc = 0;
  for (int64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x)
    acc = fold(kind, acc, fabs(double(compute_t<T>(x[i]))), p);
  acc = block_fold(kind, acc);
  if (threadIdx.x == 0) parts[blockIdx.x] = acc;
}

// One block over every part, always the same way: the same bits on every run.
__global__ void norm_finish_kernel(const double* parts, int64_t count, NormKind kind, double* out) {
  double acc = 0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) acc = combine(kind, acc, parts[i]);
  acc = block_fold(kind, acc);
  if (threadIdx.x == 0) *out = acc;
}

/// Scales by `scale`, or by *by where `by` is set (a coefficient the device computed).
template <class T>
__global__ void scale_kernel(TensorList<1> list, double scale, const double* by) {
  const BlockRange r = block_range(list);
  T* x = static_cast<T*>(list.data[0][r.tensor]);
  const compute_t<T> s = compute_t<T>(by != nullptr ? *by : scale);
  for (int64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x)
    x[i] = T(compute_t<T>(x[i]) * s);
}

// norm = {power_sum^(1/p) (or power_sum), the clipping coefficient}, as the CPU computes them.
__global__ void clip_coefficient_kernel(const double* power_sum, double p, double max_norm,
                                        double* norm) {
  const double total = isinf(p) ? *power_sum : pow(*power_sum, 1.0 / p);
  const double scale = max_norm / (total + 1e-6);
  norm[0] = total;
  norm[1] = scale >= 1 ? 1.0 : scale;
}

__global__ void adam_advance_kernel(double* s, double beta1, double beta2) {
  s[0] += 1;
  s[2] = 1 - pow(beta1, s[0]);
  s[3] = 1 - pow(beta2, s[0]);
}

template <class P, class T = compute_t<P>>
__global__ void adam_many_kernel(TensorList<4> list, AdamStep step) {
  if (step.scalars != nullptr) {
    step.lr = step.scalars[0];
    step.correction1 = step.scalars[1];
    step.correction2 = step.scalars[2];
  }
  const BlockRange r = block_range(list);
  P* p = static_cast<P*>(list.data[0][r.tensor]);
  const P* g = static_cast<const P*>(list.data[1][r.tensor]);
  T* m = static_cast<T*>(list.data[2][r.tensor]);
  T* v = static_cast<T*>(list.data[3][r.tensor]);
  const auto c = common::adam_constants<T>(step, list.weight_decay[r.tensor]);
  for (int64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) {
    T value = T(p[i]);
    functors::adam_element(value, T(g[i]), m[i], v[i], c);
    p[i] = P(value);
  }
}

NormKind norm_kind(double p) {
  if (std::isinf(p)) return NormKind::MaxAbs;
  if (p == 2) return NormKind::SumSquares;
  return p == 1 ? NormKind::SumAbs : NormKind::SumPower;
}

/// The tensors of xs whose dtype is `dtype`, as one-tensor rows.
std::vector<std::array<Tensor, 1>> of_dtype(const std::vector<Tensor>& xs, DType dtype) {
  std::vector<std::array<Tensor, 1>> rows;
  for (const Tensor& x : xs)
    if (x.dtype() == dtype) rows.push_back({x});
  return rows;
}

constexpr DType kFloatingDtypes[] = {kFloat32, kBFloat16, kFloat16, kFloat64};

}  // namespace

void norm_power_sum(const std::vector<Tensor>& xs, double p, const Tensor& out) {
  const int device = out.device().index;
  DeviceGuard guard(device);
  cudaStream_t s = weave::cuda::stream(device);
  const NormKind kind = norm_kind(p);
  const int64_t blocks = total_blocks(xs);
  Tensor parts = empty({std::max<int64_t>(blocks, 1)}, {.dtype = kFloat64, .device = out.device()});
  auto* pparts = static_cast<double*>(parts.data_ptr());
  int64_t written = 0;
  for (DType dtype : kFloatingDtypes) {
    visit_param_dtype(dtype, "norm_power_sum", [&](auto tag) {
      using T = typename decltype(tag)::type;
      for_each_list<1>(of_dtype(xs, dtype), {}, [&](const auto& list, int64_t n, int64_t) {
        norm_parts_kernel<T><<<unsigned(n), kThreads, 0, s>>>(list, kind, p, pparts + written);
        check_launch("norm_power_sum");
        written += n;
      });
    });
  }
  norm_finish_kernel<<<1, 1024, 0, s>>>(pparts, written, kind,
                                        static_cast<double*>(out.data_ptr()));
  check_launch("norm_power_sum");
}

namespace {
void scale_lists(const std::vector<Tensor>& xs, double scale, const double* by, cudaStream_t s) {
  for (DType dtype : kFloatingDtypes) {
    visit_param_dtype(dtype, "scale_many", [&](auto tag) {
      using T = typename decltype(tag)::type;
      for_each_list<1>(of_dtype(xs, dtype), {}, [&](const auto& list, int64_t n, int64_t) {
        scale_kernel<T><<<unsigned(n), kThreads, 0, s>>>(list, scale, by);
        check_launch("scale_many");
      });
    });
  }
}
}  // namespace

void scale_many(const std::vector<Tensor>& xs, double scale) {
  if (xs.empty()) return;
  const int device = xs.front().device().index;
  DeviceGuard guard(device);
  scale_lists(xs, scale, nullptr, weave::cuda::stream(device));
}

void clip_many(const std::vector<Tensor>& xs, const Tensor& power_sum, double p, double max_norm,
               const Tensor& norm) {
  const int device = norm.device().index;
  DeviceGuard guard(device);
  cudaStream_t s = weave::cuda::stream(device);
  auto* out = static_cast<double*>(norm.data_ptr());
  clip_coefficient_kernel<<<1, 1, 0, s>>>(static_cast<const double*>(power_sum.data_ptr()), p,
                                          max_norm, out);
  check_launch("clip_many");
  scale_lists(xs, 0, out + 1, s);
}

void adam_advance(const Tensor& scalars, double beta1, double beta2) {
  const int device = scalars.device().index;
  DeviceGuard guard(device);
  adam_advance_kernel<<<1, 1, 0, weave::cuda::stream(device)>>>(
      static_cast<double*>(scalars.data_ptr()), beta1, beta2);
  check_launch("adam_advance");
}

void adam_update_many(const std::vector<AdamTensors>& tensors, const AdamStep& step) {
  if (tensors.empty()) return;
  const int device = tensors.front().param.device().index;
  DeviceGuard guard(device);
  cudaStream_t s = weave::cuda::stream(device);
  for (DType dtype : kFloatingDtypes) {
    std::vector<std::array<Tensor, 4>> rows;
    std::vector<double> decay;
    for (const AdamTensors& t : tensors) {
      if (t.param.dtype() != dtype) continue;
      rows.push_back({t.param, t.grad, t.exp_avg, t.exp_avg_sq});
      decay.push_back(t.weight_decay);
    }
    visit_param_dtype(dtype, "adam_update", [&](auto tag) {
      using P = typename decltype(tag)::type;
      for_each_list<4>(rows, decay, [&](const auto& list, int64_t n, int64_t) {
        adam_many_kernel<P><<<unsigned(n), kThreads, 0, s>>>(list, step);
        check_launch("adam_update");
      });
    });
  }
}

}  // namespace weave::kernels::cuda
