// CUDA elementwise kernels: one strided N-ary launcher serves unary, binary, where, copy, fill.
#include <array>

#include "weave/kernels/backends.h"
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
  auto ix = make_indexer<1 + sizeof...(TI)>({&out, &ins...});
  const unsigned blocks = std::min<unsigned>(blocks_for(n, kThreads), 65535u * 8);
  map_kernel<F, TO, TI...><<<blocks, kThreads, 0, weave::cuda::stream(out.device().index)>>>(
      f, n, ix, static_cast<TO*>(out.data_ptr()), static_cast<const TI*>(ins.data_ptr())...);
  check_launch("cuda elementwise");
}

template <class Functor>
struct Apply {
  template <class T>
  __device__ T operator()(T x) const {
    return Functor{}(x);
  }
};
template <class Functor>
struct ApplyGrad {
  template <class T>
  __device__ T operator()(T g, T x, T y) const {
    return g * Functor{}.grad(x, y);
  }
};
template <class Functor>
struct ApplyBinary {
  template <class T>
  __device__ auto operator()(T a, T b) const {
    return Functor{}(a, b);
  }
};
struct Select {
  template <class T>
  __device__ T operator()(bool c, T a, T b) const {
    return c ? a : b;
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

void unary(UnaryOp op, const Tensor& x, const Tensor& out) {
  visit_unary_op(op, [&](auto functor, const char* name) {
    using F = typename decltype(functor)::type;
    visit_unary<F>(x.dtype(), name, [&](auto tag) {
      using T = typename decltype(tag)::type;
      map<T, T>(Apply<F>{}, out, x);
    });
  });
}

void unary_backward(UnaryOp op, const Tensor& grad, const Tensor& x, const Tensor& y,
                    const Tensor& out) {
  visit_unary_op(op, [&](auto functor, const char* name) {
    using F = typename decltype(functor)::type;
    visit_unary<F>(x.dtype(), name, [&](auto tag) {
      using T = typename decltype(tag)::type;
      map<T, T, T, T>(ApplyGrad<F>{}, out, grad, x, y);
    });
  });
}

void binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  visit_binary_op(op, [&](auto functor, const char* name) {
    using F = typename decltype(functor)::type;
    auto body = [&](auto tag) {
      using T = typename decltype(tag)::type;
      using Out = std::conditional_t<kComparison<F>, bool, T>;
      map<Out, T, T>(ApplyBinary<F>{}, out, a, b);
    };
    if constexpr (kComparison<F>)
      visit_dtype(a.dtype(), body);
    else
      visit_arithmetic(a.dtype(), name, body);
  });
}

void bias_activation(UnaryOp op, const Tensor& x, const Tensor& bias, const Tensor& out) {
  visit_unary_op(op, [&](auto functor, const char* name) {
    using F = typename decltype(functor)::type;
    visit_floating(x.dtype(), name, [&](auto tag) {
      using T = typename decltype(tag)::type;
      map<T, T, T>(functors::BiasApply<F>{}, out, x, bias);
    });
  });
}

void bias_activation_backward(UnaryOp op, const Tensor& grad, const Tensor& x, const Tensor& bias,
                              const Tensor& out) {
  visit_unary_op(op, [&](auto functor, const char* name) {
    using F = typename decltype(functor)::type;
    visit_floating(x.dtype(), name, [&](auto tag) {
      using T = typename decltype(tag)::type;
      map<T, T, T, T>(functors::BiasApplyGrad<F>{}, out, grad, x, bias);
    });
  });
}

void addcmul(const Tensor& self, const Tensor& a, const Tensor& b, double value, bool divide,
             const Tensor& out) {
  visit_floating(out.dtype(), divide ? "addcdiv_" : "addcmul_", [&](auto tag) {
    using T = typename decltype(tag)::type;
    map<T, T, T, T>(functors::AddCMulDiv{value, divide}, out, self, a, b);
  });
}

void lerp(const Tensor& self, const Tensor& end, double weight, const Tensor& out) {
  visit_floating(out.dtype(), "lerp_", [&](auto tag) {
    using T = typename decltype(tag)::type;
    map<T, T, T>(functors::Lerp{weight}, out, self, end);
  });
}

void where(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) {
  visit_dtype(a.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    map<T, bool, T, T>(Select{}, out, cond, a, b);
  });
}

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
