#pragma once
// What every backend's elementwise kernels share: which functor runs for an op and dtype, and
// in which types. A backend supplies only how to run a functor over tensors: a type `Map` with
//
//   template <class TO, class... TI, class F>
//   static void run(F f, const Tensor& out, const <one Tensor per TI>&... ins);
//
// (cpu/loops.h's strided loops, cuda/elementwise.cu's kernels), and forwards each kernel of
// backends.h here. C++17 and host/device-neutral: nvcc compiles it too.
#include <type_traits>

#include "weave/kernels/functors.h"
#include "weave/kernels/kernels.h"

namespace weave::kernels::common {

template <class Functor>
struct ApplyUnary {
  template <class T>
  WEAVE_HD T operator()(T x) const {
    return Functor{}(x);
  }
};
template <class Functor>
struct ApplyUnaryGrad {
  template <class T>
  WEAVE_HD T operator()(T g, T x, T y) const {
    return g * Functor{}.grad(x, y);
  }
};
template <class Functor>
struct ApplyBinary {
  template <class T>
  WEAVE_HD auto operator()(T a, T b) const {
    return Functor{}(a, b);
  }
};
struct Select {
  template <class T>
  WEAVE_HD T operator()(bool c, T a, T b) const {
    return c ? a : b;
  }
};

template <class T, class>
using Same = T;

// out = Apply<F>{}(ins...) for op's functor F, in `dtype`: as the plain op (Bias = false, over
// visit_unary's dtypes) or fused after a bias (visit_bias_activation's).
template <class Map, bool Bias, template <class> class Apply, class... Ins>
void activation(UnaryOp op, DType dtype, const Tensor& out, const Ins&... ins) {
  visit_unary_op(op, [&](auto functor, const char* name) {
    using F = typename decltype(functor)::type;
    auto typed = [&](auto tag) {
      using T = typename decltype(tag)::type;
      Map::template run<T, Same<T, Ins>...>(Apply<F>{}, out, ins...);
    };
    if constexpr (Bias)
      visit_bias_activation<F>(dtype, name, typed);
    else
      visit_unary<F>(dtype, name, typed);
  });
}

template <class Map>
void unary(UnaryOp op, const Tensor& x, const Tensor& out) {
  activation<Map, false, ApplyUnary>(op, x.dtype(), out, x);
}
template <class Map>
void unary_backward(UnaryOp op, const Tensor& grad, const Tensor& x, const Tensor& y,
                    const Tensor& out) {
  activation<Map, false, ApplyUnaryGrad>(op, x.dtype(), out, grad, x, y);
}
template <class Map>
void bias_activation(UnaryOp op, const Tensor& x, const Tensor& bias, const Tensor& out) {
  activation<Map, true, functors::BiasApply>(op, x.dtype(), out, x, bias);
}
template <class Map>
void bias_activation_backward(UnaryOp op, const Tensor& grad, const Tensor& x, const Tensor& bias,
                              const Tensor& out) {
  activation<Map, true, functors::BiasApplyGrad>(op, x.dtype(), out, grad, x, bias);
}

template <class Map>
void gated_activation(UnaryOp op, const Tensor& gate, const Tensor& up, const Tensor& out) {
  activation<Map, true, functors::GateApply>(op, gate.dtype(), out, gate, up);
}
template <class Map>
void gated_activation_backward(UnaryOp op, const Tensor& grad, const Tensor& gate, const Tensor& up,
                               const Tensor& dgate, const Tensor& dup) {
  activation<Map, true, functors::GateApplyGradGate>(op, gate.dtype(), dgate, grad, gate, up);
  activation<Map, true, functors::GateApplyGradUp>(op, gate.dtype(), dup, grad, gate);
}

template <class Map>
void binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  visit_binary_op(op, [&](auto functor, const char* name) {
    using F = typename decltype(functor)::type;
    auto body = [&](auto tag) {
      using T = typename decltype(tag)::type;
      using Out = std::conditional_t<kComparison<F>, bool, T>;
      Map::template run<Out, T, T>(ApplyBinary<F>{}, out, a, b);
    };
    if constexpr (kComparison<F>)
      visit_dtype(a.dtype(), body);
    else
      visit_arithmetic(a.dtype(), name, body);
  });
}

template <class Map>
void addcmul(const Tensor& self, const Tensor& a, const Tensor& b, double value, bool divide,
             const Tensor& out) {
  visit_floating(out.dtype(), divide ? "addcdiv_" : "addcmul_", [&](auto tag) {
    using T = typename decltype(tag)::type;
    Map::template run<T, T, T, T>(functors::AddCMulDiv{value, divide}, out, self, a, b);
  });
}

template <class Map>
void lerp(const Tensor& self, const Tensor& end, double weight, const Tensor& out) {
  visit_floating(out.dtype(), "lerp_", [&](auto tag) {
    using T = typename decltype(tag)::type;
    Map::template run<T, T, T>(functors::Lerp{weight}, out, self, end);
  });
}

template <class Map>
void where(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) {
  visit_dtype(a.dtype(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    Map::template run<T, bool, T, T>(Select{}, out, cond, a, b);
  });
}

}  // namespace weave::kernels::common

/// Define, in a backend's namespace, the elementwise kernels of backends.h whose bodies are
/// shared (above), over the backend's Map. Three groups, so that a backend whose compiler takes
/// long over them (the CPU's vectorized loops) can build each in a translation unit of its own.

/// unary and unary_backward.
#define WEAVE_SHARED_UNARY_KERNELS(Map)                                                 \
  void unary(UnaryOp op, const Tensor& x, const Tensor& out) {                          \
    common::unary<Map>(op, x, out);                                                     \
  }                                                                                     \
  void unary_backward(UnaryOp op, const Tensor& grad, const Tensor& x, const Tensor& y, \
                      const Tensor& out) {                                              \
    common::unary_backward<Map>(op, grad, x, y, out);                                   \
  }

/// The bias and gated activations, forward and backward.
#define WEAVE_SHARED_FUSED_ACTIVATION_KERNELS(Map)                                             \
  void bias_activation(UnaryOp op, const Tensor& x, const Tensor& bias, const Tensor& out) {   \
    common::bias_activation<Map>(op, x, bias, out);                                            \
  }                                                                                            \
  void bias_activation_backward(UnaryOp op, const Tensor& grad, const Tensor& x,               \
                                const Tensor& bias, const Tensor& out) {                       \
    common::bias_activation_backward<Map>(op, grad, x, bias, out);                             \
  }                                                                                            \
  void gated_activation(UnaryOp op, const Tensor& gate, const Tensor& up, const Tensor& out) { \
    common::gated_activation<Map>(op, gate, up, out);                                          \
  }                                                                                            \
  void gated_activation_backward(UnaryOp op, const Tensor& grad, const Tensor& gate,           \
                                 const Tensor& up, const Tensor& dgate, const Tensor& dup) {   \
    common::gated_activation_backward<Map>(op, grad, gate, up, dgate, dup);                    \
  }

/// binary, addcmul, lerp and where.
#define WEAVE_SHARED_BINARY_KERNELS(Map)                                                        \
  void binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) {               \
    common::binary<Map>(op, a, b, out);                                                         \
  }                                                                                             \
  void addcmul(const Tensor& self, const Tensor& a, const Tensor& b, double value, bool divide, \
               const Tensor& out) {                                                             \
    common::addcmul<Map>(self, a, b, value, divide, out);                                       \
  }                                                                                             \
  void lerp(const Tensor& self, const Tensor& end, double weight, const Tensor& out) {          \
    common::lerp<Map>(self, end, weight, out);                                                  \
  }                                                                                             \
  void where(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) {         \
    common::where<Map>(cond, a, b, out);                                                        \
  }

/// All three groups in one translation unit.
#define WEAVE_SHARED_ELEMENTWISE_KERNELS(Map) \
  WEAVE_SHARED_UNARY_KERNELS(Map)             \
  WEAVE_SHARED_FUSED_ACTIVATION_KERNELS(Map)  \
  WEAVE_SHARED_BINARY_KERNELS(Map)
