#pragma once
// Elementwise math, written once for CPU and CUDA. Each unary op keeps its forward and its
// derivative side by side; WEAVE_UNARY_OPS / WEAVE_BINARY_OPS list them so kernels, front
// ends and the kernel enum are generated from one place.
//
// Adding a unary op: a functor here + a line in WEAVE_UNARY_OPS + a declaration in ops.h;
// the op table test then requires a row for it.
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "weave/tensor/dtype.h"

namespace weave::functors {

#if defined(__CUDA_ARCH__)
#define WEAVE_MATH(name) ::name
#else
#define WEAVE_MATH(name) std::name
#endif

template <class T>
WEAVE_HD inline T exp_(T x) {
  return WEAVE_MATH(exp)(x);
}
template <class T>
WEAVE_HD inline T log_(T x) {
  return WEAVE_MATH(log)(x);
}
template <class T>
WEAVE_HD inline T sqrt_(T x) {
  return WEAVE_MATH(sqrt)(x);
}
template <class T>
WEAVE_HD inline T sin_(T x) {
  return WEAVE_MATH(sin)(x);
}
template <class T>
WEAVE_HD inline T cos_(T x) {
  return WEAVE_MATH(cos)(x);
}
template <class T>
WEAVE_HD inline T tanh_(T x) {
  return WEAVE_MATH(tanh)(x);
}
template <class T>
WEAVE_HD inline T erf_(T x) {
  return WEAVE_MATH(erf)(x);
}
template <class T>
WEAVE_HD inline T pow_(T x, T y) {
  if constexpr (std::is_integral_v<T>) {
    if constexpr (std::is_signed_v<T>)
      if (y < 0) return x == 1 ? 1 : 0;
    T result = 1;
    for (; y > 0; y >>= 1, x *= x)
      if (y & 1) result *= x;
    return result;
  } else {
    return WEAVE_MATH(pow)(x, y);
  }
}

// ---- optimizers: one element of a fused update --------------------------------------------

/// Adam/AdamW constants in the compute type.
template <class T>
struct AdamConstants {
  T lr_over_c1, beta1, one_minus_beta1, beta2, one_minus_beta2, correction2, eps, weight_decay,
      decay;  // decay = 1 - lr * weight_decay (AdamW)
  bool decoupled;
};

/// One element of an Adam step: m, v and p updated in place.
template <class T>
WEAVE_HD inline void adam_element(T& p, T g, T& m, T& v, const AdamConstants<T>& c) {
  if (c.weight_decay != T(0)) {
    if (c.decoupled)
      p *= c.decay;
    else
      g += c.weight_decay * p;
  }
  m = c.beta1 * m + c.one_minus_beta1 * g;
  v = c.beta2 * v + c.one_minus_beta2 * (g * g);
  p -= c.lr_over_c1 * m / (sqrt_(v / c.correction2) + c.eps);
}

template <class T>
WEAVE_HD AdamConstants<T> adam_constants(double lr, double beta1, double beta2, double eps,
                                         double wd, double correction1, double correction2,
                                         bool decoupled) {
  return {T(lr / correction1), T(beta1), T(1 - beta1), T(beta2),       T(1 - beta2),
          T(correction2),      T(eps),   T(wd),        T(1 - lr * wd), decoupled};
}

// ---- fused in-place updates (Tensor::addcmul_, addcdiv_, lerp_) ----------------------------

/// self + value * a * b, or self + value * a / b.
struct AddCMulDiv {
  double value;
  bool divide;
  template <class T>
  WEAVE_HD T operator()(T self, T a, T b) const {
    return divide ? self + T(value) * (a / b) : self + T(value) * (a * b);
  }
};
/// self + weight * (end - self).
struct Lerp {
  double weight;
  template <class T>
  WEAVE_HD T operator()(T self, T end) const {
    return self + T(weight) * (end - self);
  }
};

/// SGD constants in the compute type (PyTorch's rule; the first step copies the gradient into
/// the momentum buffer).
template <class T>
struct SgdConstants {
  T lr, momentum, one_minus_dampening, weight_decay;
  bool nesterov, first;
};

/// One element of an SGD step: the momentum buffer (when momentum != 0) and p in place.
template <class T>
WEAVE_HD inline void sgd_element(T& p, T g, T& buffer, const SgdConstants<T>& c) {
  if (c.weight_decay != T(0)) g += c.weight_decay * p;
  T direction = g;
  if (c.momentum != T(0)) {
    buffer = c.first ? g : c.momentum * buffer + c.one_minus_dampening * g;
    direction = c.nesterov ? g + c.momentum * buffer : buffer;
  }
  p -= c.lr * direction;
}

template <class T>
SgdConstants<T> sgd_constants(double lr, double momentum, double dampening, double wd,
                              bool nesterov, bool first) {
  return {T(lr), T(momentum), T(1 - dampening), T(wd), nesterov, first};
}

// ---- unary: forward(x) and derivative(x, y = forward(x)) -------------------------------
// `integral` says whether the op is defined on integer tensors; if not, they become float32.
// `reads` says which of x and y the derivative reads: backward saves only that one and passes
// it in both places.

enum class Reads { Nothing, Input, Output };

struct Neg {  // d/dx -x = -1
  static constexpr bool integral = true;
  static constexpr Reads reads = Reads::Nothing;
  template <class T>
  WEAVE_HD T operator()(T x) const {
    return -x;
  }
  template <class T>
  WEAVE_HD T grad(T, T) const {
    return T(-1);
  }
};
struct Abs {  // d/dx |x| = sign(x)
  static constexpr bool integral = true;
  static constexpr Reads reads = Reads::Input;
  template <class T>
  WEAVE_HD T operator()(T x) const {
    if constexpr (std::is_unsigned_v<T>)
      return x;
    else
      return x < T(0) ? -x : x;
  }
  template <class T>
  WEAVE_HD T grad(T x, T) const {
    if constexpr (std::is_unsigned_v<T>)
      return T(x != T(0));
    else
      return T((x > T(0)) - (x < T(0)));
  }
};
struct Exp {  // d/dx e^x = e^x
  static constexpr bool integral = false;
  static constexpr Reads reads = Reads::Output;
  template <class T>
  WEAVE_HD T operator()(T x) const {
    return exp_(x);
  }
  template <class T>
  WEAVE_HD T grad(T, T y) const {
    return y;
  }
};
struct Log {  // d/dx ln x = 1/x
  static constexpr bool integral = false;
  static constexpr Reads reads = Reads::Input;
  template <class T>
  WEAVE_HD T operator()(T x) const {
    return log_(x);
  }
  template <class T>
  WEAVE_HD T grad(T x, T) const {
    return T(1) / x;
  }
};
struct Sqrt {  // d/dx sqrt(x) = 1 / (2 sqrt(x))
  static constexpr bool integral = false;
  static constexpr Reads reads = Reads::Output;
  template <class T>
  WEAVE_HD T operator()(T x) const {
    return sqrt_(x);
  }
  template <class T>
  WEAVE_HD T grad(T, T y) const {
    return T(0.5) / y;
  }
};
struct Rsqrt {  // d/dx x^-1/2 = -x^-3/2 / 2
  static constexpr bool integral = false;
  static constexpr Reads reads = Reads::Output;
  template <class T>
  WEAVE_HD T operator()(T x) const {
    return T(1) / sqrt_(x);
  }
  template <class T>
  WEAVE_HD T grad(T, T y) const {
    return T(-0.5) * y * y * y;
  }
};
struct Sin {  // d/dx sin x = cos x
  static constexpr bool integral = false;
  static constexpr Reads reads = Reads::Input;
  template <class T>
  WEAVE_HD T operator()(T x) const {
    return sin_(x);
  }
  template <class T>
  WEAVE_HD T grad(T x, T) const {
    return cos_(x);
  }
};
struct Cos {  // d/dx cos x = -sin x
  static constexpr bool integral = false;
  static constexpr Reads reads = Reads::Input;
  template <class T>
  WEAVE_HD T operator()(T x) const {
    return cos_(x);
  }
  template <class T>
  WEAVE_HD T grad(T x, T) const {
    return -sin_(x);
  }
};
struct Tanh {  // d/dx tanh x = 1 - tanh^2 x
  static constexpr bool integral = false;
  static constexpr Reads reads = Reads::Output;
  template <class T>
  WEAVE_HD T operator()(T x) const {
    return tanh_(x);
  }
  template <class T>
  WEAVE_HD T grad(T, T y) const {
    return T(1) - y * y;
  }
};
struct Sigmoid {  // d/dx s(x) = s(x) (1 - s(x))
  static constexpr bool integral = false;
  static constexpr Reads reads = Reads::Output;
  template <class T>
  WEAVE_HD T operator()(T x) const {
    return T(1) / (T(1) + exp_(-x));
  }
  template <class T>
  WEAVE_HD T grad(T, T y) const {
    return y * (T(1) - y);
  }
};
struct Relu {  // d/dx max(x, 0) = [x > 0]; NaN propagates (x != x only for NaN)
  static constexpr bool integral = true;
  static constexpr Reads reads = Reads::Input;
  template <class T>
  WEAVE_HD T operator()(T x) const {
    return x > T(0) || x != x ? x : T(0);
  }
  template <class T>
  WEAVE_HD T grad(T x, T) const {
    return x != x ? x : x > T(0) ? T(1) : T(0);
  }
};
struct Square {  // d/dx x^2 = 2x
  static constexpr bool integral = true;
  static constexpr Reads reads = Reads::Input;
  template <class T>
  WEAVE_HD T operator()(T x) const {
    return x * x;
  }
  template <class T>
  WEAVE_HD T grad(T x, T) const {
    return x + x;
  }
};
struct Sign {  // sign(x) in {-1, 0, 1}, NaN for NaN;  d/dx = 0
  static constexpr bool integral = true;
  static constexpr Reads reads = Reads::Nothing;
  template <class T>
  WEAVE_HD T operator()(T x) const {
    if constexpr (std::is_unsigned_v<T>)
      return T(x != T(0));
    else
      return x != x ? x : T(int(x > T(0)) - int(x < T(0)));
  }
  template <class T>
  WEAVE_HD T grad(T, T) const {
    return T(0);
  }
};
struct Gelu {  // gelu(x) = x Phi(x);  d/dx = Phi(x) + x phi(x)
  static constexpr bool integral = false;
  static constexpr Reads reads = Reads::Input;
  template <class T>
  WEAVE_HD T operator()(T x) const {
    return T(0.5) * x * (T(1) + erf_(x * T(0.70710678118654752440)));
  }
  template <class T>
  WEAVE_HD T grad(T x, T) const {
    T cdf = T(0.5) * (T(1) + erf_(x * T(0.70710678118654752440)));
    return cdf + x * T(0.39894228040143267794) * exp_(T(-0.5) * x * x);
  }
};
struct GeluTanh {  // gelu(x) ~ x/2 (1 + tanh u), u = c (x + a x^3);  d/dx = (1 + t)/2 + x/2 (1 -
                   // t^2) u'
  static constexpr bool integral = false;
  static constexpr Reads reads = Reads::Input;
  static constexpr double kC = 0.79788456080286535588, kA = 0.044715;  // sqrt(2/pi)
  template <class T>
  WEAVE_HD T operator()(T x) const {
    return T(0.5) * x * (T(1) + tanh_(T(kC) * (x + T(kA) * x * x * x)));
  }
  template <class T>
  WEAVE_HD T grad(T x, T) const {
    T t = tanh_(T(kC) * (x + T(kA) * x * x * x));
    return T(0.5) * (T(1) + t) + T(0.5) * x * (T(1) - t * t) * T(kC) * (T(1) + T(3 * kA) * x * x);
  }
};
struct Silu {  // silu(x) = x s(x);  d/dx = s(x) (1 + x (1 - s(x)))
  static constexpr bool integral = false;
  static constexpr Reads reads = Reads::Input;
  template <class T>
  WEAVE_HD T operator()(T x) const {
    return x / (T(1) + exp_(-x));
  }
  template <class T>
  WEAVE_HD T grad(T x, T) const {
    T s = T(1) / (T(1) + exp_(-x));
    return s * (T(1) + x * (T(1) - s));
  }
};

// X(Name, functor, public function name)
#define WEAVE_UNARY_OPS(X)                            \
  X(Neg, ::weave::functors::Neg, neg)                 \
  X(Abs, ::weave::functors::Abs, abs)                 \
  X(Exp, ::weave::functors::Exp, exp)                 \
  X(Log, ::weave::functors::Log, log)                 \
  X(Sqrt, ::weave::functors::Sqrt, sqrt)              \
  X(Rsqrt, ::weave::functors::Rsqrt, rsqrt)           \
  X(Sin, ::weave::functors::Sin, sin)                 \
  X(Cos, ::weave::functors::Cos, cos)                 \
  X(Tanh, ::weave::functors::Tanh, tanh)              \
  X(Sigmoid, ::weave::functors::Sigmoid, sigmoid)     \
  X(Relu, ::weave::functors::Relu, relu)              \
  X(Sign, ::weave::functors::Sign, sign)              \
  X(Square, ::weave::functors::Square, square)        \
  X(Gelu, ::weave::functors::Gelu, gelu)              \
  X(GeluTanh, ::weave::functors::GeluTanh, gelu_tanh) \
  X(Silu, ::weave::functors::Silu, silu)

/// op(x + b): a bias added and an activation applied in one pass.
template <class Functor>
struct BiasApply {
  template <class T>
  WEAVE_HD T operator()(T x, T b) const {
    return Functor{}(x + b);
  }
};
/// g op'(x + b), recomputing op(x + b) for the derivatives that read the output.
template <class Functor>
struct BiasApplyGrad {
  template <class T>
  WEAVE_HD T operator()(T g, T x, T b) const {
    const T z = x + b;
    if constexpr (Functor::reads == Reads::Output)
      return g * Functor{}.grad(z, Functor{}(z));
    else
      return g * Functor{}.grad(z, z);
  }
};

/// A gated activation's output op(gate) up (SwiGLU with silu, GeGLU with gelu).
template <class Functor>
struct GateApply {
  template <class T>
  WEAVE_HD T operator()(T gate, T up) const {
    return Functor{}(gate)*up;
  }
};
/// Its gradient for the gate: g up op'(gate).
template <class Functor>
struct GateApplyGradGate {
  template <class T>
  WEAVE_HD T operator()(T g, T gate, T up) const {
    if constexpr (Functor::reads == Reads::Output)
      return g * up * Functor{}.grad(gate, Functor{}(gate));
    else
      return g * up * Functor{}.grad(gate, gate);
  }
};
/// Its gradient for up: g op(gate).
template <class Functor>
struct GateApplyGradUp {
  template <class T>
  WEAVE_HD T operator()(T g, T gate) const {
    return g * Functor{}(gate);
  }
};

// ---- dropout inside fused kernels ----------------------------------------------------------

/// Whether element `index` survives dropout with probability p under `seed`: a counter-based
/// draw (splitmix64's finalizer), so a fused kernel regenerates its mask in backward, on any
/// device and in any order, without storing it.
WEAVE_HD inline bool dropout_keep(uint64_t seed, uint64_t index, double p) {
  uint64_t z = seed + (index + 1) * 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  z ^= z >> 31;
  return double(z >> 11) * 0x1.0p-53 >= p;
}

// ---- binary (compute type in, compute type or bool out) ---------------------------------

struct Add {
  template <class T>
  WEAVE_HD T operator()(T a, T b) const {
    return a + b;
  }
};
struct Sub {
  template <class T>
  WEAVE_HD T operator()(T a, T b) const {
    return a - b;
  }
};
struct Mul {
  template <class T>
  WEAVE_HD T operator()(T a, T b) const {
    return a * b;
  }
};
struct Div {
  template <class T>
  WEAVE_HD T operator()(T a, T b) const {
    return a / b;
  }
};
struct Pow {
  template <class T>
  WEAVE_HD T operator()(T a, T b) const {
    return pow_(a, b);
  }
};
struct Maximum {  // NaN propagates
  template <class T>
  WEAVE_HD T operator()(T a, T b) const {
    return (a != a || a > b) ? a : b;
  }
};
struct Minimum {
  template <class T>
  WEAVE_HD T operator()(T a, T b) const {
    return (a != a || a < b) ? a : b;
  }
};
struct Eq {
  template <class T>
  WEAVE_HD bool operator()(T a, T b) const {
    return a == b;
  }
};
struct Ne {
  template <class T>
  WEAVE_HD bool operator()(T a, T b) const {
    return a != b;
  }
};
struct Lt {
  template <class T>
  WEAVE_HD bool operator()(T a, T b) const {
    return a < b;
  }
};
struct Le {
  template <class T>
  WEAVE_HD bool operator()(T a, T b) const {
    return a <= b;
  }
};
struct Gt {
  template <class T>
  WEAVE_HD bool operator()(T a, T b) const {
    return a > b;
  }
};
struct Ge {
  template <class T>
  WEAVE_HD bool operator()(T a, T b) const {
    return a >= b;
  }
};

#define WEAVE_ARITHMETIC_OPS(X)  \
  X(Add, ::weave::functors::Add) \
  X(Sub, ::weave::functors::Sub) \
  X(Mul, ::weave::functors::Mul) \
  X(Div, ::weave::functors::Div) \
  X(Pow, ::weave::functors::Pow) \
  X(Maximum, ::weave::functors::Maximum) X(Minimum, ::weave::functors::Minimum)
#define WEAVE_COMPARISON_OPS(X) \
  X(Eq, ::weave::functors::Eq)  \
  X(Ne, ::weave::functors::Ne)  \
  X(Lt, ::weave::functors::Lt)  \
  X(Le, ::weave::functors::Le) X(Gt, ::weave::functors::Gt) X(Ge, ::weave::functors::Ge)

}  // namespace weave::functors
