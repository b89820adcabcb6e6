// CUDA elementwise kernels: one strided N-ary launcher serves unary, binary, where, copy, fill.
#include <algorithm>
#include <array>
#include <cstdint>
#include <tuple>
#include <utility>

#include "weave/kernels/backends.h"
#include "weave/kernels/common/elementwise.h"
#include "weave/tensor/cuda/common.cuh"

namespace weave::kernels::cuda {

namespace {

// Element strides of N operands over one shape (dims of size 1 dropped).
template <int N>
struct Indexer {
  int rank = 0;
  bool contiguous = true;
  int64_t sizes[kMaxDims];
  int64_t strides[N][kMaxDims];

  __device__ void offsets(int64_t linear, int64_t (&off)[N]) const {
    for (int k = 0; k < N; ++k) off[k] = contiguous ? linear : 0;
    if (contiguous) return;
    for (int d = rank - 1; d >= 0; --d) {
      int64_t i = linear % sizes[d];
      linear /= sizes[d];
      for (int k = 0; k < N; ++k) off[k] += i * strides[k][d];
    }
  }
};

template <int N>
Indexer<N> make_indexer(const std::array<const Tensor*, N>& tensors) {
  Indexer<N> ix;
  const Shape& shape = tensors[0]->shape();
  for (int k = 0; k < N; ++k) ix.contiguous = ix.contiguous && tensors[k]->is_contiguous();
  for (int d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    ix.sizes[ix.rank] = shape[d];
    for (int k = 0; k < N; ++k) ix.strides[k][ix.rank] = tensors[k]->strides()[d];
    ++ix.rank;
  }
  return ix;
}

template <class F, class TO, class... TI>
__global__ void map_kernel(F f, int64_t n, Indexer<1 + sizeof...(TI)> ix, TO* out,
                           const TI*... in) {
  constexpr int N = 1 + sizeof...(TI);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t off[N];
    ix.offsets(i, off);
    int k = 1;
    out[off[0]] = TO(f(compute_t<TI>(in[off[k++]])...));
  }
}

// The vectorized path: each thread moves E consecutive elements of every operand with one
// 16-byte access (a scalar path moves 2 to 8 bytes per access, far from the memory's rate).
// Operands are laid out as the contiguous output (dense), as a row repeated along the leading
// dims (a bias: stride 1 in the last dim, 0 elsewhere), or as one element (strides all 0).
enum Layout : unsigned { kDense = 0, kRow = 1, kScalar = 2, kStrided = 3 };

template <class T, int E>
struct alignas(sizeof(T) * E) Pack {
  T v[E];
};

template <int E, class T>
__device__ Pack<T, E> load_pack(const T* p, int64_t i, int64_t col, unsigned layout) {
  if (layout == kScalar) {
    Pack<T, E> r;
#pragma unroll
    for (int e = 0; e < E; ++e) r.v[e] = p[0];
    return r;
  }
  return *reinterpret_cast<const Pack<T, E>*>(p + (layout == kRow ? col : i));
}

template <int E, class F, class TO, class... TI, size_t... K>
__device__ void map_pack(F f, int64_t i, int64_t col, unsigned layouts, std::index_sequence<K...>,
                         TO* out, const TI*... in) {
  const auto packs = std::make_tuple(load_pack<E>(in, i, col, (layouts >> (2 * K)) & 3u)...);
  Pack<TO, E> o;
#pragma unroll
  for (int e = 0; e < E; ++e) o.v[e] = TO(f(compute_t<TI>(std::get<K>(packs).v[e])...));
  *reinterpret_cast<Pack<TO, E>*>(out + i) = o;
}

template <int E, class F, class TO, class... TI>
__global__ void map_vec_kernel(F f, int64_t groups, int64_t cols, unsigned layouts, TO* out,
                               const TI*... in) {
  for (int64_t g = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; g < groups;
       g += int64_t(gridDim.x) * blockDim.x)
    map_pack<E>(f, g * E, g * E % cols, layouts, std::index_sequence_for<TI...>{}, out, in...);
}

/// t's layout for the vectorized path, for an operand of the output's shape.
Layout vector_layout(const Tensor& t) {
  if (t.is_contiguous()) return kDense;
  const int last = t.dim() - 1;
  bool leading_zero = true;
  for (int d = 0; d < last; ++d)
    leading_zero = leading_zero && (t.size(d) == 1 || t.strides()[d] == 0);
  if (leading_zero && (t.size(last) == 1 || t.strides()[last] == 0)) return kScalar;
  return leading_zero && t.strides()[last] == 1 ? kRow : kStrided;
}

/// Launches map_vec_kernel when every operand allows it (see Layout; aligned packs that never
/// straddle a row); returns false otherwise.
template <class TO, class... TI, class F, class... Ts>
bool map_vectorized(F f, const Tensor& out, const Ts&... ins) {
  constexpr size_t widest = std::max({sizeof(TO), sizeof(TI)...});
  constexpr int E = int(16 / widest);
  const int64_t n = out.numel(), cols = out.dim() > 0 ? out.size(-1) : 1;
  if (E < 2 || !out.is_contiguous() || n % E != 0) return false;
  auto aligned = [](const void* p, size_t bytes) {
    return reinterpret_cast<uintptr_t>(p) % bytes == 0;
  };
  if (!aligned(out.data_ptr(), sizeof(TO) * E)) return false;
  unsigned layouts = 0, k = 0;
  bool ok = true;
  auto admit = [&](const Tensor& t, size_t size) {
    const Layout layout = t.dim() == out.dim() ? vector_layout(t) : kStrided;
    ok = ok && layout != kStrided && (layout == kScalar || aligned(t.data_ptr(), size * E)) &&
         (layout != kRow || cols % E == 0);
    layouts |= unsigned(layout) << (2 * k++);
  };
  (admit(ins, sizeof(TI)), ...);
  if (!ok) return false;
  const int64_t groups = n / E;
  const unsigned blocks = grid_stride_blocks(groups);
  map_vec_kernel<E, F, TO, TI...><<<blocks, kThreads, 0, weave::cuda::stream(out.device().index)>>>(
      f, groups, cols, layouts, static_cast<TO*>(out.data_ptr()),
      static_cast<const TI*>(ins.data_ptr())...);
  check_launch("cuda elementwise");
  return true;
}

template <class>
struct TensorFor {
  using type = Tensor;
};

/// out = f(ins...) elementwise on the output's device.
template <class TO, class... TI, class F>
void map(F f, const Tensor& out, const typename TensorFor<TI>::type&... ins) {
  const int64_t n = out.numel();
  if (n == 0) return;
  DeviceGuard guard(out.device().index);
  if (map_vectorized<TO, TI...>(f, out, ins...)) return;
  auto ix = make_indexer<1 + sizeof...(TI)>({&out, &ins...});
  const unsigned blocks = grid_stride_blocks(n);
  map_kernel<F, TO, TI...><<<blocks, kThreads, 0, weave::cuda::stream(out.device().index)>>>(
      f, n, ix, static_cast<TO*>(out.data_ptr()), static_cast<const TI*>(ins.data_ptr())...);
  check_launch("cuda elementwise");
}

/// The kernels as common/elementwise.h's Map.
struct KernelMap {
  template <class TO, class... TI, class F>
  static void run(F f, const Tensor& out, const typename TensorFor<TI>::type&... ins) {
    map<TO, TI...>(f, out, ins...);
  }
};

struct Identity {
  template <class T>
  __device__ T operator()(T x) const {
    return x;
  }
};
template <class T>
struct Constant {
  T value;
  __device__ compute_t<T> operator()() const { return compute_t<T>(value); }
};

}  // namespace

WEAVE_SHARED_ELEMENTWISE_KERNELS(KernelMap)

void copy(const Tensor& src, const Tensor& dst) {
  if (src.dtype() == dst.dtype() && src.is_contiguous() && dst.is_contiguous()) {
    DeviceGuard guard(dst.device().index);
    WEAVE_CHECK_CALL(
        cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), src.numel() * src.itemsize(),
                        cudaMemcpyDeviceToDevice, weave::cuda::stream(dst.device().index)),
        "copy");
    return;
  }
  visit_dtype(dst.dtype(), [&](auto out_tag) {
    using TO = typename decltype(out_tag)::type;
    visit_dtype(src.dtype(), [&](auto in_tag) {
      using TI = typename decltype(in_tag)::type;
      map<TO, TI>(Identity{}, dst, src);
    });
  });
}

void fill(const Tensor& dst, double value) {
  visit_dtype(dst.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    map<T>(Constant<T>{T(static_cast<compute_t<T>>(value))}, dst);
  });
}

}  // namespace weave::kernels::cuda
