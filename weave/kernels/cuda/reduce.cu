// CUDA reductions over the middle of [outer, reduced, inner], and index gathers/scatters.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "weave/kernels/backends.h"
#include "weave/tensor/cuda/common.cuh"

namespace weave::kernels::cuda {

namespace {

template <class T>
using acc_t = std::conditional_t<std::is_floating_point_v<compute_t<T>>, compute_t<T>, int64_t>;

/// Folds (v, vi) into (acc, ai): sums add; extrema keep the larger (smaller) value, NaN above
/// everything, and the lowest index among ties (so ArgMax/ArgMin agree with the CPU).
template <class A>
__device__ inline void combine(ReduceOp op, A& acc, int64_t& ai, A v, int64_t vi) {
  if (op == ReduceOp::Sum) {
    acc += v;
    return;
  }
  const bool want_max = op == ReduceOp::Max || op == ReduceOp::ArgMax;
  const bool acc_nan = acc != acc, v_nan = v != v;
  const bool take =
      acc_nan ? v_nan && vi < ai : v_nan || (want_max ? v > acc : v < acc) || (v == acc && vi < ai);
  if (take) {
    acc = v;
    ai = vi;
  }
}

/// Combines (acc, ai) across the block; thread 0 returns the result.
template <class A>
__device__ void block_combine(ReduceOp op, A& acc, int64_t& ai) {
  __shared__ A values[32];
  __shared__ int64_t indices[32];
  for (int step = 16; step > 0; step /= 2) {
    const A v = __shfl_down_sync(0xffffffffu, acc, step);
    const int64_t vi = __shfl_down_sync(0xffffffffu, ai, step);
    if (int(threadIdx.x % 32) + step < 32) combine(op, acc, ai, v, vi);
  }
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  if (threadIdx.x % 32 == 0) {
    values[warp] = acc;
    indices[warp] = ai;
  }
  __syncthreads();
  if (threadIdx.x == 0)
    for (int w = 1; w < warps; ++w) combine(op, acc, ai, values[w], indices[w]);
}

/// Where a pass writes: the final output (index or value), or partials for a second pass.
template <class A, class O>
struct Sink {
  O* out;
  A* values;
  int64_t* indices;
  bool want_index;
  __device__ void put(int64_t at, A value, int64_t index) const {
    if (values) {
      values[at] = value;
      indices[at] = index;
    } else if constexpr (std::is_same_v<O, int64_t>) {
      out[at] = want_index ? index : O(value);
    } else {
      out[at] = O(compute_t<O>(value));
    }
  }
};

// Rows (inner == 1): block (o, part) reduces part `part` of row o, 4 loads in flight a thread.
template <class T, class A, class O>
__global__ void reduce_rows_kernel(ReduceOp op, const T* x, int64_t reduced, int64_t chunk,
                                   Sink<A, O> sink) {
  const int64_t o = blockIdx.x, part = blockIdx.y, parts = gridDim.y;
  const int64_t begin = part * chunk, end = min(reduced, begin + chunk);
  const T* row = x + o * reduced;
  A acc = op == ReduceOp::Sum ? A(0) : A(compute_t<T>(row[begin]));
  int64_t ai = begin;
  const int64_t stride = blockDim.x;
  int64_t k = begin + threadIdx.x;
  for (; k + 3 * stride < end; k += 4 * stride) {
    const A v0 = A(compute_t<T>(row[k])), v1 = A(compute_t<T>(row[k + stride]));
    const A v2 = A(compute_t<T>(row[k + 2 * stride])), v3 = A(compute_t<T>(row[k + 3 * stride]));
    if (op == ReduceOp::Sum) {
      acc += (v0 + v1) + (v2 + v3);
    } else {
      combine(op, acc, ai, v0, k);
      combine(op, acc, ai, v1, k + stride);
      combine(op, acc, ai, v2, k + 2 * stride);
      combine(op, acc, ai, v3, k + 3 * stride);
    }
  }
  for (; k < end; k += stride) combine(op, acc, ai, A(compute_t<T>(row[k])), k);
  block_combine(op, acc, ai);
  if (threadIdx.x == 0) sink.put(o * parts + part, acc, ai);
}

// Columns (inner > 1): a thread per output column (coalesced along inner); blockIdx.y splits
// the reduced dim into parts when there are too few columns to fill the device.
template <class T, class A, class O>
__global__ void reduce_columns_kernel(ReduceOp op, const T* x, int64_t outer, int64_t reduced,
                                      int64_t inner, int64_t chunk, Sink<A, O> sink) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= outer * inner) return;
  const int64_t o = c / inner, j = c % inner, part = blockIdx.y, parts = gridDim.y;
  const int64_t begin = part * chunk, end = min(reduced, begin + chunk);
  const T* base = x + o * reduced * inner + j;
  A acc = op == ReduceOp::Sum ? A(0) : A(compute_t<T>(base[begin * inner]));
  int64_t ai = begin;
#pragma unroll 4
  for (int64_t k = begin; k < end; ++k) combine(op, acc, ai, A(compute_t<T>(base[k * inner])), k);
  sink.put(c * parts + part, acc, ai);
}

// The second pass: a warp per output over its parts' partial results.
template <class A, class O>
__global__ void reduce_parts_kernel(ReduceOp op, const A* values, const int64_t* indices,
                                    int64_t outputs, int64_t parts, Sink<A, O> sink) {
  const int64_t o = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (o >= outputs) return;
  A acc = op == ReduceOp::Sum ? A(0) : values[o * parts];
  int64_t ai = indices[o * parts];
  for (int64_t p = lane; p < parts; p += 32)
    combine(op, acc, ai, values[o * parts + p], indices[o * parts + p]);
  for (int step = 16; step > 0; step /= 2) {
    const A v = __shfl_down_sync(0xffffffffu, acc, step);
    const int64_t vi = __shfl_down_sync(0xffffffffu, ai, step);
    if (lane + step < 32) combine(op, acc, ai, v, vi);
  }
  if (lane == 0) sink.put(o, acc, ai);
}

/// Into how many parts to split each output's reduction so that the launch fills the device
/// (about 4 blocks of 256 threads per multiprocessor), each part keeping at least min_chunk
/// elements a block (rows) or a thread (columns).
int64_t parts_for(int64_t outputs_in_blocks, int64_t reduced, int64_t min_chunk, int device) {
  const int64_t wanted = int64_t(weave::cuda::device_properties(device).multiProcessorCount) * 4;
  if (outputs_in_blocks >= wanted) return 1;
  const int64_t by_work = std::max<int64_t>(1, reduced / min_chunk);
  return std::min<int64_t>({(wanted + outputs_in_blocks - 1) / outputs_in_blocks, by_work, 1024});
}

template <class T, class O>
void launch_reduce(ReduceOp op, const Tensor& x, int64_t outer, int64_t reduced, int64_t inner,
                   O* out, cudaStream_t s) {
  using A = acc_t<T>;
  const int device = x.device().index;
  const T* px = static_cast<const T*>(x.data_ptr());
  const bool want_index = op == ReduceOp::ArgMax || op == ReduceOp::ArgMin;
  const int64_t outputs = outer * inner;
  const int64_t column_blocks = (outputs + kThreads - 1) / kThreads;
  int64_t parts = inner == 1 ? parts_for(outputs, reduced, 2048, device)
                             : parts_for(column_blocks, reduced, 64, device);
  const int64_t chunk = (reduced + parts - 1) / parts;
  parts = (reduced + chunk - 1) / chunk;  // no part left empty
  Sink<A, O> final_sink{out, nullptr, nullptr, want_index};
  Tensor values, indices;
  Sink<A, O> sink = final_sink;
  if (parts > 1) {
    values = empty({outputs * parts * int64_t(sizeof(A))}, {.dtype = kUInt8, .device = x.device()});
    indices = empty({outputs * parts}, {.dtype = kInt64, .device = x.device()});
    sink = {out, static_cast<A*>(values.data_ptr()), static_cast<int64_t*>(indices.data_ptr()),
            want_index};
  }
  WEAVE_CHECK(outputs <= 0x7fffffff && column_blocks <= 0x7fffffff, "reduce",
              "too many outputs ({}) for one launch", outputs);
  if (inner == 1) {
    reduce_rows_kernel<T, A, O><<<dim3(unsigned(outputs), unsigned(parts)), kThreads, 0, s>>>(
        op, px, reduced, chunk, sink);
  } else {
    reduce_columns_kernel<T, A, O>
        <<<dim3(unsigned(column_blocks), unsigned(parts)), kThreads, 0, s>>>(op, px, outer, reduced,
                                                                             inner, chunk, sink);
  }
  check_launch("reduce");
  if (parts > 1) {
    reduce_parts_kernel<A, O><<<blocks_for(outputs * 32, kThreads), kThreads, 0, s>>>(
        op, sink.values, sink.indices, outputs, parts, final_sink);
    check_launch("reduce");
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
    } else if constexpr (std::is_same_v<T, BFloat16>) {
      atomicAdd(reinterpret_cast<__nv_bfloat16*>(target), __float2bfloat16(float(src[i])));
    } else if constexpr (std::is_same_v<T, Half>) {
      atomicAdd(reinterpret_cast<__half*>(target), __float2half(float(src[i])));
    } else {
      atomicAdd(target, src[i]);
    }
  }
}

template <class T>
__global__ void gather_weighted_sum_kernel(const T* rows, const int64_t* index, const T* weight,
                                           int64_t tokens, int64_t k, int64_t h, T* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < tokens * h;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / h, c = i % h;
    T sum = 0;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t from = index[t * k + j];
      if (from >= 0) sum += weight[t * k + j] * rows[from * h + c];
    }
    out[i] = sum;
  }
}

// d_rows (zeroed first) gathers weight x grad where the index points (atomically: two tokens
// may pick one row).
template <class T>
__global__ void gather_weighted_sum_rows_kernel(const T* grad, const int64_t* index,
                                                const T* weight, int64_t tokens, int64_t k,
                                                int64_t h, T* d_rows) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < tokens * k * h;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t slot = i / h, c = i % h, from = index[slot];
    if (from >= 0) atomicAdd(d_rows + from * h + c, weight[slot] * grad[(slot / k) * h + c]);
  }
}

// d_weight: one warp per slot, the dot product over h in its lanes.
template <class T>
__global__ void gather_weighted_sum_weight_kernel(const T* grad, const T* rows,
                                                  const int64_t* index, int64_t slots, int64_t k,
                                                  int64_t h, T* d_weight) {
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t slot = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; slot < slots;
       slot += warps) {
    const int64_t from = index[slot];
    T dot = 0;
    if (from >= 0)
      for (int64_t c = threadIdx.x % 32; c < h; c += 32)
        dot += grad[(slot / k) * h + c] * rows[from * h + c];
    for (int offset = 16; offset > 0; offset /= 2)
      dot += __shfl_down_sync(0xffffffffu, dot, offset);
    if (threadIdx.x % 32 == 0) d_weight[slot] = dot;
  }
}

template <class Fn>
void float_or_double(DType dtype, const char* op, const Fn& fn) {
  if (dtype == kFloat32) return fn(float{});
  if (dtype == kFloat64) return fn(double{});
  WEAVE_FAIL(op, "expected float32 or float64, found {}", dtype);
}

}  // namespace

void gather_weighted_sum(const Tensor& rows, const Tensor& index, const Tensor& weight,
                         const Tensor& out) {
  const int64_t tokens = out.size(0), h = out.size(1), k = index.size(1);
  if (tokens * h == 0) return;
  DeviceGuard guard(out.device().index);
  float_or_double(out.dtype(), "gather_weighted_sum", [&](auto zero) {
    using T = decltype(zero);
    gather_weighted_sum_kernel<T>
        <<<grid_stride_blocks(tokens * h), kThreads, 0, weave::cuda::stream(out.device().index)>>>(
            rows.data<T>(), index.data<int64_t>(), weight.data<T>(), tokens, k, h, out.data<T>());
    check_launch("gather_weighted_sum");
  });
}

void gather_weighted_sum_backward(const Tensor& grad, const Tensor& rows, const Tensor& index,
                                  const Tensor& weight, const Tensor& d_rows,
                                  const Tensor& d_weight) {
  const int64_t tokens = grad.size(0), h = grad.size(1), k = index.size(1);
  DeviceGuard guard(grad.device().index);
  cudaStream_t s = weave::cuda::stream(grad.device().index);
  WEAVE_CHECK_CALL(cudaMemsetAsync(d_rows.data_ptr(), 0, d_rows.numel() * d_rows.itemsize(), s),
                   "gather_weighted_sum_backward");
  if (tokens * k == 0) return;
  float_or_double(grad.dtype(), "gather_weighted_sum_backward", [&](auto zero) {
    using T = decltype(zero);
    if (h > 0)
      gather_weighted_sum_rows_kernel<T><<<grid_stride_blocks(tokens * k * h), kThreads, 0, s>>>(
          grad.data<T>(), index.data<int64_t>(), weight.data<T>(), tokens, k, h, d_rows.data<T>());
    gather_weighted_sum_weight_kernel<T><<<grid_stride_blocks(tokens * k * 32), kThreads, 0, s>>>(
        grad.data<T>(), rows.data<T>(), index.data<int64_t>(), tokens * k, k, h,
        d_weight.data<T>());
    check_launch("gather_weighted_sum_backward");
  });
}

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
  visit_dtype(x.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T, bool>) {
      WEAVE_FAIL("reduce", "bool tensors are reduced as integers; hint: .to(kInt64)");
    } else {
      if (op == ReduceOp::ArgMax || op == ReduceOp::ArgMin)
        launch_reduce<T, int64_t>(op, x, outer, reduced, inner,
                                  static_cast<int64_t*>(out.data_ptr()), s);
      else
        launch_reduce<T, T>(op, x, outer, reduced, inner, static_cast<T*>(out.data_ptr()), s);
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
        <<<grid_stride_blocks(total), kThreads, 0, weave::cuda::stream(src.device().index)>>>(
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
    index_add_kernel<T><<<grid_stride_blocks(total), kThreads, 0, s>>>(
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
    case kBFloat16:
      return launch(static_cast<BFloat16*>(dst.data_ptr()),
                    static_cast<const BFloat16*>(src.data_ptr()));
    case kFloat16:
      return launch(static_cast<Half*>(dst.data_ptr()), static_cast<const Half*>(src.data_ptr()));
    default:
      WEAVE_FAIL("index_add",
                 "CUDA index_add supports float32, float64, bfloat16, float16, int32 and int64, "
                 "found {}",
                 dst.dtype());
  }
}

}  // namespace weave::kernels::cuda
