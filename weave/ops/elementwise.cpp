// Elementwise ops: front ends and their derivatives, side by side.
#include <cmath>

#include "weave/autograd/grad_mode.h"
#include "weave/ops/autocast.h"
#include "weave/ops/internal.h"

namespace weave {

using namespace detail;
using kernels::BinaryOp;
using kernels::UnaryOp;

namespace detail {

Tensor broadcast_view(const Tensor& t, const Shape& shape) {
  if (t.shape() == shape) return t;
  const int offset = shape.size() - t.dim();
  Strides strides = Dims::filled(shape.size(), 0);
  for (int i = 0; i < t.dim(); ++i)
    strides[offset + i] = t.shape()[i] == 1 && shape[offset + i] != 1 ? 0 : t.strides()[i];
  return make_view(t, shape, strides, t.offset());
}

}  // namespace detail

// ---- unary: one template serves every op in WEAVE_UNARY_OPS ---------------------------

namespace {

template <class Functor>
Tensor unary_op(const Tensor& x, UnaryOp op, const char* name, const char* backward_name) {
  check_defined(x, name);
  if (Tensor xc = autocast_input(x, name); !xc.is_same(x))
    return unary_op<Functor>(xc, op, name, backward_name);
  WEAVE_CHECK(x.dtype() != kBool || !Functor::integral, name,
              "expected a numeric tensor, found bool; hint: .to(kInt64)");
  const DType dtype = Functor::integral ? x.dtype() : to_floating(x.dtype());
  Tensor input = convert(x, dtype);
  Tensor y = empty_on(x.shape(), dtype, x.device());
  kernels::unary(op, input, y);
  // d/dx f(x) lives next to f in kernels/functors.h; the kernel multiplies it by the gradient.
  return autograd::record(backward_name, {x}, y, [&] {
    const Tensor& read = Functor::reads == functors::Reads::Output ? y : input;
    return
        [op, saved = Functor::reads == functors::Reads::Nothing ? SavedTensor() : SavedTensor(read),
         shape = x.shape(), in_dtype = x.dtype(), dtype](const BackwardArgs& args) -> Grads {
          Tensor g = convert(args.grad(), dtype);
          // The derivative ignores the operand it does not read, so one tensor serves as both.
          Tensor operand = saved.defined() ? saved.unpack() : g;
          Tensor dx = empty_on(shape, dtype, g.device());
          kernels::unary_backward(op, g, operand, operand, dx);
          return {convert(dx, in_dtype)};
        };
  });
}

}  // namespace

#define WEAVE_DEFINE_UNARY(Name, Functor, function)                          \
  Tensor function(const Tensor& x) {                                         \
    return unary_op<Functor>(x, UnaryOp::Name, #function, #Name "Backward"); \
  }
WEAVE_UNARY_OPS(WEAVE_DEFINE_UNARY)
#undef WEAVE_DEFINE_UNARY

// ---- binary -----------------------------------------------------------------------------

namespace {

struct Operands {
  Tensor a, b;  // converted to dtype and broadcast to shape
  Shape shape;
  DType dtype;
};

Operands prepare(const Tensor& a, const Tensor& b, const char* op, bool floating = false) {
  check_defined(a, op, "lhs");
  check_defined(b, op, "rhs");
  check_same_device(a, b, op);
  Operands p;
  p.shape = broadcast_shapes(a.shape(), b.shape(), op);
  p.dtype = promote_types(a.dtype(), b.dtype());
  if (floating) p.dtype = to_floating(p.dtype);
  p.a = broadcast_view(convert(a, p.dtype), p.shape);
  p.b = broadcast_view(convert(b, p.dtype), p.shape);
  return p;
}

Tensor compute(BinaryOp op, const Operands& p) {
  Tensor out = empty_on(p.shape, kernels::is_comparison(op) ? kBool : p.dtype, p.a.device());
  kernels::binary(op, p.a, p.b, out);
  return out;
}

Tensor arithmetic(BinaryOp op, const Tensor& a, const Tensor& b, const char* name,
                  bool floating = false) {
  Operands p = prepare(a, b, name, floating);
  WEAVE_CHECK(p.dtype != kBool, name, "expected numeric tensors, found bool; hint: .to(kInt64)");
  return compute(op, p);
}

}  // namespace

Tensor add(const Tensor& a, const Tensor& b) {
  // d(a+b) = (g, g)
  return autograd::record("AddBackward", {a, b}, arithmetic(BinaryOp::Add, a, b, "add"), [&] {
    return [ai = InputInfo(a), bi = InputInfo(b)](const BackwardArgs& args) -> Grads {
      const Tensor& g = args.grad();
      return {args.needs(0) ? reduce_grad(g, ai) : Tensor(),
              args.needs(1) ? reduce_grad(g, bi) : Tensor()};
    };
  });
}

Tensor sub(const Tensor& a, const Tensor& b) {
  // d(a-b) = (g, -g)
  return autograd::record("SubBackward", {a, b}, arithmetic(BinaryOp::Sub, a, b, "sub"), [&] {
    return [ai = InputInfo(a), bi = InputInfo(b)](const BackwardArgs& args) -> Grads {
      const Tensor& g = args.grad();
      return {args.needs(0) ? reduce_grad(g, ai) : Tensor(),
              args.needs(1) ? reduce_grad(neg(g), bi) : Tensor()};
    };
  });
}

Tensor mul(const Tensor& a, const Tensor& b) {
  // d(ab) = (g b, g a)
  return autograd::record("MulBackward", {a, b}, arithmetic(BinaryOp::Mul, a, b, "mul"), [&] {
    return [as = SavedTensor(a), bs = SavedTensor(b)](const BackwardArgs& args) -> Grads {
      const Tensor& g = args.grad();
      Tensor av = as.unpack(), bv = bs.unpack();
      return {args.needs(0) ? reduce_grad(g * bv, av) : Tensor(),
              args.needs(1) ? reduce_grad(g * av, bv) : Tensor()};
    };
  });
}

Tensor div(const Tensor& a, const Tensor& b) {
  // d(a/b) = (g / b, -g a / b^2)
  return autograd::record("DivBackward", {a, b}, arithmetic(BinaryOp::Div, a, b, "div", true), [&] {
    return [as = SavedTensor(a), bs = SavedTensor(b)](const BackwardArgs& args) -> Grads {
      const Tensor& g = args.grad();
      Tensor av = as.unpack(), bv = bs.unpack();
      return {args.needs(0) ? reduce_grad(g / bv, av) : Tensor(),
              args.needs(1) ? reduce_grad(-g * av / (bv * bv), bv) : Tensor()};
    };
  });
}

Tensor pow(const Tensor& base, const Tensor& exponent) {
  check_defined(base, "pow", "base");
  check_defined(exponent, "pow", "exponent");
  if (Tensor bc = autocast_input(base, "pow", "base"); !bc.is_same(base)) return pow(bc, exponent);
  if (!is_floating(base.dtype()) && !is_floating(exponent.dtype()) && exponent.numel() > 0)
    WEAVE_CHECK(min(exponent).item<int64_t>() >= 0, "pow",
                "integers to negative integer powers are not allowed (the result is a "
                "fraction); hint: convert the base with .to(kFloat32) first");
  Tensor y = arithmetic(BinaryOp::Pow, base, exponent, "pow");
  // d(a^b) = (g b a^(b-1), g a^b ln a), the second taken as 0 where a == 0
  return autograd::record("PowBackward", {base, exponent}, y, [&] {
    return [as = SavedTensor(base), bs = SavedTensor(exponent),
            ys = SavedTensor(y)](const BackwardArgs& args) -> Grads {
      const Tensor& g = args.grad();
      Tensor a = as.unpack(), b = bs.unpack();
      Tensor da, db;
      if (args.needs(0)) da = reduce_grad(g * b * pow(a, b - 1.0), a);
      if (args.needs(1)) {
        Tensor safe_log = where(eq(a, wrap_scalar(0, a)), zeros_like(a), log(a));
        db = reduce_grad(g * ys.unpack() * safe_log, b);
      }
      return {da, db};
    };
  });
}

Tensor pow(const Tensor& base, double exponent) {
  return pow(base, wrap_scalar(exponent, base));
}

namespace {
// Gradient share of `a` for max/min: 1 where it wins, 1/2 at ties, 0 where it loses.
Tensor winner_share(const Tensor& a, const Tensor& b, BinaryOp wins) {
  Operands p = prepare(a, b, "maximum");
  Tensor win = convert(compute(wins, p), p.dtype);
  Tensor tie = convert(compute(BinaryOp::Eq, p), p.dtype);
  return win + tie * 0.5;
}

Tensor extremum(const Tensor& a, const Tensor& b, BinaryOp op, BinaryOp wins, const char* name,
                const char* backward_name) {
  return autograd::record(backward_name, {a, b}, arithmetic(op, a, b, name), [&] {
    return [as = SavedTensor(a), bs = SavedTensor(b), wins](const BackwardArgs& args) -> Grads {
      Tensor av = as.unpack(), bv = bs.unpack();
      Tensor share = winner_share(av, bv, wins);
      const Tensor& g = args.grad();
      return {args.needs(0) ? reduce_grad(g * share, av) : Tensor(),
              args.needs(1) ? reduce_grad(g * (1.0 - share), bv) : Tensor()};
    };
  });
}
}  // namespace

Tensor maximum(const Tensor& a, const Tensor& b) {
  return extremum(a, b, BinaryOp::Maximum, BinaryOp::Gt, "maximum", "MaximumBackward");
}
Tensor minimum(const Tensor& a, const Tensor& b) {
  return extremum(a, b, BinaryOp::Minimum, BinaryOp::Lt, "minimum", "MinimumBackward");
}

#define WEAVE_DEFINE_COMPARISON(function, Name)               \
  Tensor function(const Tensor& a, const Tensor& b) {         \
    return compute(BinaryOp::Name, prepare(a, b, #function)); \
  }
WEAVE_DEFINE_COMPARISON(eq, Eq)
WEAVE_DEFINE_COMPARISON(ne, Ne)
WEAVE_DEFINE_COMPARISON(lt, Lt)
WEAVE_DEFINE_COMPARISON(le, Le)
WEAVE_DEFINE_COMPARISON(gt, Gt)
WEAVE_DEFINE_COMPARISON(ge, Ge)
#undef WEAVE_DEFINE_COMPARISON

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  check_defined(cond, "where", "cond");
  WEAVE_CHECK(cond.dtype() == kBool, "where",
              "expected a bool condition, found {}; hint: use a comparison", cond.dtype());
  check_same_device(cond, a, "where");
  Operands p = prepare(a, b, "where");
  Shape shape = broadcast_shapes(cond.shape(), p.shape, "where");
  Tensor out = empty_on(shape, p.dtype, a.device());
  kernels::where(broadcast_view(cond, shape), broadcast_view(p.a, shape),
                 broadcast_view(p.b, shape), out);
  // d where(c, a, b) = (where(c, g, 0), where(c, 0, g))
  return autograd::record("WhereBackward", {a, b}, out, [&] {
    return [cs = SavedTensor(cond), ai = InputInfo(a),
            bi = InputInfo(b)](const BackwardArgs& args) -> Grads {
      const Tensor& g = args.grad();
      Tensor c = cs.unpack(), zero = zeros_like(g);
      return {args.needs(0) ? reduce_grad(where(c, g, zero), ai) : Tensor(),
              args.needs(1) ? reduce_grad(where(c, zero, g), bi) : Tensor()};
    };
  });
}

Tensor clamp(const Tensor& x, std::optional<double> min, std::optional<double> max) {
  check_defined(x, "clamp");
  WEAVE_CHECK(min || max, "clamp", "expected a min or a max bound, found neither");
  WEAVE_CHECK(!(min && std::isnan(*min)) && !(max && std::isnan(*max)), "clamp",
              "a bound is NaN (min {}, max {}); hint: leave a bound out with std::nullopt",
              min ? *min : 0.0, max ? *max : 0.0);
  WEAVE_CHECK(!min || !max || *min <= *max, "clamp", "min {} is above max {}", *min, *max);
  WEAVE_CHECK(x.dtype() != kBool, "clamp", "expected a numeric tensor, found bool");
  Tensor y;
  {
    NoGradGuard no_grad;  // maximum/minimum keep NaN; the gradient below is clamp's own
    y = x;
    if (min) y = maximum(y, wrap_scalar(*min, x));
    if (max) y = minimum(y, wrap_scalar(*max, x));
    if (y.is_same(x)) y = x.clone();
  }
  // d clamp(x) = g where min <= x <= max, else 0 (a NaN x compares false: 0)
  return autograd::record("ClampBackward", {x}, y, [&] {
    return [xs = SavedTensor(x), min, max](const BackwardArgs& args) -> Grads {
      const Tensor x = xs.unpack();
      Tensor g = args.grad(), zero = zeros_like(g);
      if (min) g = where(ge(x, wrap_scalar(*min, x)), g, zero);
      if (max) g = where(le(x, wrap_scalar(*max, x)), g, zero);
      return {g};
    };
  });
}

Tensor isnan(const Tensor& x) {
  check_defined(x, "isnan");
  return ne(x, x);
}

Tensor isinf(const Tensor& x) {
  check_defined(x, "isinf");
  if (!is_floating(x.dtype())) return zeros(x.shape(), {.dtype = kBool, .device = x.device()});
  return eq(abs(x), wrap_scalar(INFINITY, x));
}

Tensor isfinite(const Tensor& x) {
  check_defined(x, "isfinite");
  if (!is_floating(x.dtype())) return ones(x.shape(), {.dtype = kBool, .device = x.device()});
  // x - x is 0 for every finite x and NaN for inf and NaN.
  return eq(x - x, wrap_scalar(0, x));
}

bool all_finite(const Tensor& x) {
  check_defined(x, "all_finite");
  if (!is_floating(x.dtype()) || x.numel() == 0) return true;
  NoGradGuard no_grad;
  // A finite sum means every element is finite (NaN and inf propagate): one pass, no temporary.
  if (std::isfinite(sum(x.detach()).to(kFloat64).item<double>())) return true;
  // The sum may have overflowed: 0 * x is 0 for finite x and NaN otherwise, and a sum of zeros
  // cannot overflow.
  return std::isfinite(sum(x.detach() * 0.0).to(kFloat64).item<double>());
}

bool all_finite(const std::vector<Tensor>& tensors) {
  NoGradGuard no_grad;
  Tensor total;  // float64 on the first tensor's device: sums of finite floats cannot overflow it
  for (const Tensor& t : tensors) {
    if (!t.defined() || !is_floating(t.dtype()) || t.numel() == 0) continue;
    Tensor part = sum(t.detach()).to(kFloat64);
    total = total.defined() ? total + part.to(total.device()) : part;
  }
  if (!total.defined() || std::isfinite(total.item<double>())) return true;
  // Some tensor's own sum overflowed or is not finite: ask each one exactly.
  for (const Tensor& t : tensors)
    if (t.defined() && !all_finite(t)) return false;
  return true;
}

// ---- scalars and operators --------------------------------------------------------------

Tensor wrap_scalar(double value, const Tensor& like) {
  check_defined(like, "scalar");
  DType dtype = like.dtype();
  const bool integral_value = std::isfinite(value) && value == std::floor(value);
  if (!is_floating(dtype) && !integral_value) dtype = kFloat32;
  if (dtype == kBool) dtype = kInt64;
  return full({}, value, {.dtype = dtype, .device = like.device()});
}

Tensor operator+(const Tensor& a, const Tensor& b) {
  return add(a, b);
}
Tensor operator-(const Tensor& a, const Tensor& b) {
  return sub(a, b);
}
Tensor operator*(const Tensor& a, const Tensor& b) {
  return mul(a, b);
}
Tensor operator/(const Tensor& a, const Tensor& b) {
  return div(a, b);
}
Tensor operator-(const Tensor& x) {
  return neg(x);
}
Tensor operator+(const Tensor& a, double b) {
  return add(a, wrap_scalar(b, a));
}
Tensor operator-(const Tensor& a, double b) {
  return sub(a, wrap_scalar(b, a));
}
Tensor operator*(const Tensor& a, double b) {
  return mul(a, wrap_scalar(b, a));
}
Tensor operator/(const Tensor& a, double b) {
  return div(a, wrap_scalar(b, a));
}
Tensor operator+(double a, const Tensor& b) {
  return add(wrap_scalar(a, b), b);
}
Tensor operator-(double a, const Tensor& b) {
  return sub(wrap_scalar(a, b), b);
}
Tensor operator*(double a, const Tensor& b) {
  return mul(wrap_scalar(a, b), b);
}
Tensor operator/(double a, const Tensor& b) {
  return div(wrap_scalar(a, b), b);
}

}  // namespace weave
