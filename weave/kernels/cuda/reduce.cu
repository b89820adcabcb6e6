// CUDA reductions over the middle of [outer, reduced, inner], and index gathers/scatters.
#include "weave/kernels/backends.h"
#include "weave/tensor/cuda/common.cuh"

namespace weave::kernels::cuda {

namespace {

template <class T>
using acc_t = std::conditional_t<std::is_floating_point_v<compute_t<T>>, compute_t<T>, int64_t>;

// One block per output element; threads stride over the reduced dimension, then combine in
// shared memory. ArgMax/ArgMin carry the index along (lowest index wins ties, NaN wins).
template <class T, class O>
__global__ void reduce_kernel(ReduceOp op, const T* x, int64_t reduced, int64_t inner, O* out) {
  using A = acc_t<T>;
  __shared__ A values[kThreads];
  __shared__ int64_t indices[kThreads];
  const int64_t o = blockIdx.x / inner, j = blockIdx.x % inner;
  const T* base = x + o * reduced * inner + j;
  const bool sum = op == ReduceOp::Sum;
  const bool want_max = op == ReduceOp::Max || op == ReduceOp::ArgMax;
  A acc = sum ? A(0) : A(compute_t<T>(base[0]));
  int64_t best = 0;
  for (int64_t k = threadIdx.x; k < reduced; k += blockDim.x) {
    A v = A(compute_t<T>(base[k * inner]));
    if (sum) {
      acc += v;
    } else if (v != v ? !(acc != acc) || k < best
                      : !(acc != acc) && (want_max ? v > acc : v < acc)) {
      acc = v;
      best = k;
    } else if (!(v != v) && v == acc && k < best) {
      best = k;
    }
  }
  values[threadIdx.x] = acc;
  indices[threadIdx.x] = best;
  __syncthreads();
  for (int step = blockDim.x / 2; step > 0; step /= 2) {
    if (threadIdx.x < step) {
      A a = values[threadIdx.x], b = values[threadIdx.x + step];
      int64_t ia = indices[threadIdx.x], ib = indices[threadIdx.x + step];
      if (sum) {
        values[threadIdx.x] = a + b;
      } else {
        bool a_nan = a != a, b_nan = b != b;
        bool take_b =
            a_nan ? (b_nan && ib < ia) : b_nan || (want_max ? b > a : b < a) || (b == a && ib < ia);
        if (take_b) {
          values[threadIdx.x] = b;
          indices[threadIdx.x] = ib;
        }
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    if constexpr (std::is_same_v<O, int64_t>) {
      out[blockIdx.x] = indices[0];
    } else {
      out[blockIdx.x] = O(compute_t<O>(values[0]));
    }
  }
}

template <class T>
__global__ void index_select_kernel(const T* src, int64_t outer, int64_t n, int64_t inner,
                                    const int64_t* index, int64_t count, T* out) {
  const int64_t total = outer * count * inner;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t j = i % inner, c = (i / inner) % count, o = i / (inner * count);
    out[i] = src[(o * n + index[c]) * inner + j];
  }
}

template <class T>
__global__ void index_add_kernel(T* dst, int64_t outer, int64_t n, int64_t inner,
                                 const int64_t* index, int64_t count, const T* src) {
  const int64_t total = outer * count * inner;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t j = i % inner, c = (i / inner) % count, o = i / (inner * count);
    T* target = dst + (o * n + index[c]) * inner + j;
    if constexpr (std::is_same_v<T, int64_t>) {
      atomicAdd(reinterpret_cast<unsigned long long*>(target),
                static_cast<unsigned long long>(src[i]));
    } else {
      atomicAdd(target, src[i]);
    }
  }
}

unsigned grid_for(int64_t n) {
  return std::min<unsigned>(blocks_for(n, kThreads), 65535u * 8);
}

}  // namespace

void reduce(ReduceOp op, const Tensor& x, int64_t outer, int64_t reduced, int64_t inner,
            const Tensor& out) {
  const int64_t outputs = outer * inner;
  if (outputs == 0) return;
  DeviceGuard guard(x.device().index);
  cudaStream_t s = weave::cuda::stream(x.device().index);
  if (reduced == 0) {  // only sums reach here with nothing to reduce
    WEAVE_CHECK_CALL(cudaMemsetAsync(out.data_ptr(), 0, outputs * out.itemsize(), s), "reduce");
    return;
  }
  WEAVE_CHECK(outputs <= 0x7fffffff, "reduce", "too many outputs ({}) for one launch", outputs);
  visit_dtype(x.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T, bool>) {
      WEAVE_FAIL("reduce", "bool tensors are reduced as integers; hint: .to(kInt64)");
    } else {
      const T* px = static_cast<const T*>(x.data_ptr());
      const unsigned blocks = static_cast<unsigned>(outputs);
      if (op == ReduceOp::ArgMax || op == ReduceOp::ArgMin) {
        reduce_kernel<T, int64_t><<<blocks, kThreads, 0, s>>>(
            op, px, reduced, inner, static_cast<int64_t*>(out.data_ptr()));
      } else {
        reduce_kernel<T, T>
            <<<blocks, kThreads, 0, s>>>(op, px, reduced, inner, static_cast<T*>(out.data_ptr()));
      }
      check_launch("reduce");
    }
  });
}

void index_select(const Tensor& src, int64_t outer, int64_t n, int64_t inner, const Tensor& index,
                  const Tensor& out) {
  const int64_t total = out.numel();
  if (total == 0) return;
  DeviceGuard guard(src.device().index);
  visit_dtype(src.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    index_select_kernel<T>
        <<<grid_for(total), kThreads, 0, weave::cuda::stream(src.device().index)>>>(
            static_cast<const T*>(src.data_ptr()), outer, n, inner, index.data<int64_t>(),
            index.numel(), static_cast<T*>(out.data_ptr()));
    check_launch("index_select");
  });
}

void index_add(const Tensor& dst, int64_t outer, int64_t n, int64_t inner, const Tensor& index,
               const Tensor& src) {
  const int64_t total = src.numel();
  if (total == 0) return;
  DeviceGuard guard(dst.device().index);
  cudaStream_t s = weave::cuda::stream(dst.device().index);
  auto launch = [&](auto* d, const auto* from) {
    using T = std::remove_pointer_t<decltype(d)>;
    index_add_kernel<T><<<grid_for(total), kThreads, 0, s>>>(
        d, outer, n, inner, index.data<int64_t>(), index.numel(), from);
    check_launch("index_add");
  };
  switch (dst.dtype()) {
    case kFloat32:
      return launch(static_cast<float*>(dst.data_ptr()), static_cast<const float*>(src.data_ptr()));
    case kFloat64:
      return launch(static_cast<double*>(dst.data_ptr()),
                    static_cast<const double*>(src.data_ptr()));
    case kInt32:
      return launch(static_cast<int32_t*>(dst.data_ptr()),
                    static_cast<const int32_t*>(src.data_ptr()));
    case kInt64:
      return launch(static_cast<int64_t*>(dst.data_ptr()),
                    static_cast<const int64_t*>(src.data_ptr()));
    default:
      WEAVE_FAIL("index_add", "CUDA index_add supports float32, float64, int32 and int64, found {}",
                 dst.dtype());
  }
}

}  // namespace weave::kernels::cuda
