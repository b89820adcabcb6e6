#pragma once
// Kernel entry points (internal). Each dispatches on device (cpu/ or cuda/), then on dtype.
// Callers (the op front ends) have already checked arguments, allocated `out`, broadcast the
// inputs to out's shape (stride-0 views) and converted them to the computation dtype.
#include <cstdint>

#include "weave/kernels/functors.h"
#include "weave/tensor/tensor.h"

namespace weave::kernels {

enum class UnaryOp : uint8_t {
#define WEAVE_ENUM(Name, Functor, fn) Name,
  WEAVE_UNARY_OPS(WEAVE_ENUM)
#undef WEAVE_ENUM
};

enum class BinaryOp : uint8_t {
#define WEAVE_ENUM(Name, Functor) Name,
  WEAVE_ARITHMETIC_OPS(WEAVE_ENUM) WEAVE_COMPARISON_OPS(WEAVE_ENUM)
#undef WEAVE_ENUM
};

inline bool is_comparison(BinaryOp op) {
  return op >= BinaryOp::Eq;
}

/// visit_dtype over the dtypes arithmetic is defined on (all but bool).
template <class Fn>
void visit_arithmetic(DType dtype, const char* op, Fn&& fn) {
  WEAVE_CHECK(dtype != kBool, op, "expected a numeric dtype, found bool; hint: .to(kInt64)");
  visit_dtype(dtype, [&](auto tag) {
    if constexpr (!std::is_same_v<typename decltype(tag)::type, bool>) fn(tag);
  });
}

/// Calls fn(type_tag<float>{}) or fn(type_tag<double>{}); any other dtype raises naming op.
template <class Fn>
void visit_floating(DType dtype, const char* op, Fn&& fn) {
  if (dtype == kFloat32) return fn(type_tag<float>{});
  if (dtype == kFloat64) return fn(type_tag<double>{});
  WEAVE_FAIL(op, "expected float32 or float64, found {}", dtype);
}

/// visit_arithmetic restricted to the dtypes unary op Functor is instantiated for: floating
/// only, unless the op is defined on integers.
template <class Functor, class Fn>
void visit_unary(DType dtype, const char* op, Fn&& fn) {
  visit_arithmetic(dtype, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (Functor::integral || std::is_floating_point_v<compute_t<T>>) {
      fn(tag);
    } else {
      WEAVE_FAIL(op, "expected a floating dtype, found {}", dtype);
    }
  });
}

/// Calls fn(type_tag<Functor>{}, name) with the functor that implements a unary op.
template <class Fn>
void visit_unary_op(UnaryOp op, Fn&& fn) {
  switch (op) {
#define WEAVE_CASE(Name, Functor, function) \
  case UnaryOp::Name:                       \
    return fn(type_tag<Functor>{}, #function);
    WEAVE_UNARY_OPS(WEAVE_CASE)
#undef WEAVE_CASE
  }
}

/// Calls fn(type_tag<Functor>{}, name) with the functor that implements a binary op.
template <class Fn>
void visit_binary_op(BinaryOp op, Fn&& fn) {
  switch (op) {
#define WEAVE_CASE(Name, Functor) \
  case BinaryOp::Name:            \
    return fn(type_tag<Functor>{}, #Name);
    WEAVE_ARITHMETIC_OPS(WEAVE_CASE) WEAVE_COMPARISON_OPS(WEAVE_CASE)
#undef WEAVE_CASE
  }
}

/// True for the binary functors that return bool.
template <class Functor>
inline constexpr bool kComparison = std::is_same_v<decltype(Functor{}(1, 1)), bool>;

enum class ReduceOp : uint8_t { Sum, Max, Min, ArgMax, ArgMin };

/// The CPU kernels' thread budget, one value for the whole process (OpenMP's own setting
/// belongs to each calling thread, so a communication worker would otherwise use every core).
void set_max_threads(int threads);
int max_threads();

/// out = op(x); x and out have one dtype.
void unary(UnaryOp op, const Tensor& x, const Tensor& out);
/// out = grad * op'(x) where y = op(x).
void unary_backward(UnaryOp op, const Tensor& grad, const Tensor& x, const Tensor& y,
                    const Tensor& out);
/// out = op(a, b); a and b share a dtype; out has it too, or bool for comparisons.
void binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out);
/// out = self + value * a * b (or a / b with divide); one floating dtype, one shape (inputs
/// may be broadcast views).
void addcmul(const Tensor& self, const Tensor& a, const Tensor& b, double value, bool divide,
             const Tensor& out);
/// out = self + weight * (end - self).
void lerp(const Tensor& self, const Tensor& end, double weight, const Tensor& out);
/// out = cond ? a : b; cond is bool.
void where(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out);
/// dst = src elementwise, converting dtype, across devices.
void copy(const Tensor& src, const Tensor& dst);
void fill(const Tensor& dst, double value);
/// x is contiguous and viewed as [outer, reduced, inner]; out is [outer, inner] (contiguous).
/// ArgMax/ArgMin write int64 indices into the reduced dimension.
void reduce(ReduceOp op, const Tensor& x, int64_t outer, int64_t reduced, int64_t inner,
            const Tensor& out);
/// out[b] = a[b] @ b[b] for 3-D a [B, M, K], b [B, K, N] (a row- or column-major inner
/// layout, batch stride may be 0) into contiguous out [B, M, N]; with accumulate, out[b] +=
/// (GEMM's beta = 1: a bias placed in out first costs no extra pass).
void matmul(const Tensor& a, const Tensor& b, const Tensor& out, bool accumulate = false);
/// src contiguous viewed as [outer, n, inner]; out[o, i, :] = src[o, index[i], :].
void index_select(const Tensor& src, int64_t outer, int64_t n, int64_t inner, const Tensor& index,
                  const Tensor& out);
/// dst contiguous viewed as [outer, n, inner]; dst[o, index[i], :] += src[o, i, :].
void index_add(const Tensor& dst, int64_t outer, int64_t n, int64_t inner, const Tensor& index,
               const Tensor& src);

/// The constants of one Adam/AdamW step (correction1/2: 1 - beta1^t, 1 - beta2^t).
struct AdamStep {
  double lr, beta1, beta2, eps, weight_decay, correction1, correction2;
  bool decoupled;  // AdamW: p *= 1 - lr * wd; Adam: g += wd * p
};
/// One fused Adam update, in place, in a single pass over contiguous float32/float64 tensors of
/// one dtype and device: m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
/// p -= lr / c1 * m / (sqrt(v / c2) + eps).
void adam_update(const Tensor& param, const Tensor& grad, const Tensor& exp_avg,
                 const Tensor& exp_avg_sq, const AdamStep& step);

struct SgdStep {
  double lr, momentum, dampening, weight_decay;
  bool nesterov;
  bool first;  // the momentum buffer takes the gradient as is (PyTorch's first step)
};
/// One fused SGD update, in place, in a single pass over contiguous float32/float64 tensors of
/// one dtype and device: g += wd p; buf = momentum buf + (1 - dampening) g (or g at first);
/// p -= lr (nesterov ? g + momentum buf : buf). momentum_buffer is ignored without momentum.
void sgd_update(const Tensor& param, const Tensor& grad, const Tensor& momentum_buffer,
                const SgdStep& step);

}  // namespace weave::kernels
