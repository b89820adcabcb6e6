// Neural-network ops: softmax family, losses, normalization, embedding, dropout.
#include "weave/autograd/grad_mode.h"
#include "weave/ops/autocast.h"
#include "weave/ops/captured_step.h"
#include "weave/ops/internal.h"

namespace weave {

using namespace detail;

namespace {

Tensor floating(const Tensor& x) {
  return convert(x, to_floating(x.dtype()));
}

// A loss reduced to one number: summed (and divided by `count`, or by the element count) in
// float32 when the losses are float16 or bfloat16, then rounded once to `out_dtype`. In float16
// the sum of 65,536 ordinary losses is already infinite.
Tensor reduce_loss(const Tensor& loss, Reduction reduction, DType out_dtype,
                   std::optional<double> count = std::nullopt) {
  if (reduction == Reduction::None) return loss.to(out_dtype);
  Tensor wide = is_reduced_float(loss.dtype()) ? loss.to(kFloat32) : loss;
  if (reduction == Reduction::Sum) return sum(wide).to(out_dtype);
  return (sum(wide) / count.value_or(double(loss.numel()))).to(out_dtype);
}

}  // namespace

namespace {

/// t in the kernel dtype with dim `d` moved last, contiguous (a row per remaining index).
Tensor rows_along(const Tensor& t, int d, DType dtype) {
  Tensor moved = d == t.dim() - 1 ? t : t.transpose(d, -1);
  return convert(moved, dtype).contiguous();
}

Tensor softmax_family(const Tensor& x, int64_t dim, bool log) {
  const char* op = log ? "log_softmax" : "softmax";
  check_defined(x, op);
  if (Tensor xc = autocast_input(x, op); !xc.is_same(x)) return softmax_family(xc, dim, log);
  const int d = normalize_dim(dim, x.dim(), op);
  const DType out_dtype = to_floating(x.dtype()), dtype = kernel_dtype(out_dtype);
  // A 0-d tensor is one row of one element.
  Tensor rows = x.dim() == 0 ? convert(x, dtype).reshape({1}) : rows_along(x, d, dtype);
  Tensor y = empty_on(rows.shape(), dtype, x.device());
  kernels::softmax(rows, y, log);
  auto back_to_layout = [d, scalar = x.dim() == 0](const Tensor& t) {
    if (scalar) return t.reshape({});
    return d == t.dim() - 1 ? t : t.transpose(d, -1);
  };
  Tensor out = convert(back_to_layout(y), out_dtype);
  // softmax: dx = y (g - sum(g y));  log_softmax: dx = g - exp(y) sum(g)
  return autograd::record(log ? "LogSoftmaxBackward" : "SoftmaxBackward", {x}, out, [&] {
    return [ys = SavedTensor(y), d, log, back_to_layout,
            in = InputInfo(x)](const BackwardArgs& args) -> Grads {
      Tensor yv = ys.unpack();
      const Tensor& g = args.grad();
      Tensor g_rows =
          g.dim() == 0 ? convert(g, yv.dtype()).reshape({1}) : rows_along(g, d, yv.dtype());
      Tensor dx = empty_on(yv.shape(), yv.dtype(), yv.device());
      kernels::softmax_backward(g_rows, yv, dx, log);
      return {convert(back_to_layout(dx), in.dtype)};
    };
  });
}

/// Checks integer class targets against [0, classes) (ignore_index allowed) on the host and
/// returns how many are not ignored (the mean's divisor).
int64_t check_targets(const Tensor& target, int64_t classes, int64_t ignore_index) {
  Tensor host = target.to(kCPU).to(kInt64).contiguous();
  const int64_t* t = host.data<int64_t>();
  int64_t counted = 0;
  for (int64_t i = 0; i < host.numel(); ++i) {
    WEAVE_CHECK(t[i] == ignore_index || (t[i] >= 0 && t[i] < classes), "cross_entropy",
                "target {} at position {} is not a class in [0, {}) nor ignore_index ({})", t[i], i,
                classes, ignore_index);
    counted += t[i] != ignore_index;
  }
  return counted;
}

Tensor normalization(const char* op, bool rms, const Tensor& x, const Shape& normalized_shape,
                     const Tensor& weight, const Tensor& bias, double eps) {
  check_defined(x, op);
  if (autocast_dtype()) {
    Tensor xc = autocast_input(x, op), wc = autocast_input(weight, op, "weight");
    Tensor bc = autocast_input(bias, op, "bias");
    if (!xc.is_same(x) || (weight.defined() && !wc.is_same(weight)) ||
        (bias.defined() && !bc.is_same(bias)))
      return normalization(op, rms, xc, normalized_shape, wc, bc, eps);
  }
  WEAVE_CHECK(eps >= 0 && std::isfinite(eps), op,
              "eps must be a finite non-negative number, found {}", eps);
  const int k = normalized_shape.size();
  bool matches = k >= 1 && k <= x.dim();
  for (int i = 0; matches && i < k; ++i)
    matches = x.shape()[x.dim() - k + i] == normalized_shape[i];
  WEAVE_CHECK(matches, op, "input {} does not end with normalized_shape {}", x.shape(),
              normalized_shape);
  for (auto [t, what] : {std::pair{&weight, "weight"}, std::pair{&bias, "bias"}}) {
    if (!t->defined()) continue;
    check_same_device(x, *t, op);
    WEAVE_CHECK(t->shape() == normalized_shape, op, "expected {} of shape {}, found {}", what,
                normalized_shape, t->shape());
  }
  // Statistics in the computation dtype; on CUDA, bfloat16/float16 rows are read and written as
  // they are, and so are weights of the rows' dtype (no conversion passes around the kernels).
  const DType out_dtype = to_floating(x.dtype()), dtype = kernel_dtype(out_dtype);
  const DType row_dtype = x.device().is_cuda() && is_reduced_float(out_dtype) ? out_dtype : dtype;
  const bool params_as_rows = row_dtype != dtype && (weight.defined() || bias.defined()) &&
                              (!weight.defined() || weight.dtype() == row_dtype) &&
                              (!bias.defined() || bias.dtype() == row_dtype);
  const DType param_dtype = params_as_rows ? row_dtype : dtype;
  const int64_t n = normalized_shape.numel();
  Tensor rows = convert(x, row_dtype).contiguous().reshape({-1, n});
  auto flat = [&](const Tensor& t) {
    return t.defined() ? convert(t, param_dtype).contiguous().reshape({n}) : Tensor();
  };
  Tensor w = flat(weight), b = flat(bias);
  Tensor y = empty_on(rows.shape(), row_dtype, x.device());
  Tensor mu = rms ? Tensor() : empty_on({rows.size(0)}, dtype, x.device());
  Tensor rstd = empty_on({rows.size(0)}, dtype, x.device());
  kernels::layer_norm(rows, w, b, eps, rms, y, mu, rstd);
  Tensor out = convert(y.reshape(x.shape()), out_dtype);
  // xhat = (x - mean) rstd;  dx = rstd (g w - mean(g w) - xhat mean(g w xhat)),
  // dweight = sum over rows of g xhat, dbias = sum of g (RMS norm: no mean terms)
  return autograd::record(
      rms ? "RmsNormBackward" : "LayerNormBackward", {x, weight, bias}, out, [&] {
        return [xs = SavedTensor(rows), ws = SavedTensor(w), mu, rstd, rms, param_dtype,
                xi = InputInfo(x), wi = InputInfo(weight),
                bi = InputInfo(bias)](const BackwardArgs& args) -> Grads {
          Tensor xv = xs.unpack(), wv = ws.unpack();
          Tensor g = convert(args.grad(), xv.dtype()).contiguous();
          auto make = [&](bool needed, const Shape& shape, DType dtype) {
            return needed ? empty_on(shape, dtype, xv.device()) : Tensor();
          };
          Tensor dx = make(args.needs(0), xv.shape(), xv.dtype());
          Tensor dw = make(args.needs(1), {xv.size(1)}, param_dtype);
          Tensor db = make(args.needs(2), {xv.size(1)}, param_dtype);
          kernels::layer_norm_backward(g.reshape(xv.shape()), xv, wv, mu, rstd, rms, dx, dw, db);
          auto finish = [](const Tensor& t, const InputInfo& info) {
            return t.defined() ? convert(t.reshape(info.shape), info.dtype) : Tensor();
          };
          return {finish(dx, xi), finish(dw, wi), finish(db, bi)};
        };
      });
}

}  // namespace

Tensor softmax(const Tensor& x, int64_t dim) {
  return softmax_family(x, dim, false);
}

Tensor log_softmax(const Tensor& x, int64_t dim) {
  return softmax_family(x, dim, true);
}

Tensor cross_entropy(const Tensor& logits, const Tensor& target, Reduction reduction,
                     int64_t ignore_index) {
  check_defined(logits, "cross_entropy", "logits");
  check_defined(target, "cross_entropy", "target");
  if (Tensor lc = autocast_input(logits, "cross_entropy", "logits"); !lc.is_same(logits))
    return cross_entropy(lc, target, reduction, ignore_index);
  check_same_device(logits, target, "cross_entropy");
  WEAVE_CHECK(target.dtype() == kInt64 || target.dtype() == kInt32, "cross_entropy",
              "expected integer class targets (int64 or int32), found {}", target.dtype());
  const bool batched = logits.dim() == 2;
  WEAVE_CHECK((batched && target.dim() == 1 && target.size(0) == logits.size(0)) ||
                  (logits.dim() == 1 && target.dim() == 0),
              "cross_entropy",
              "expected logits [N, C] with target [N] (or [C] with []), found {} and {}; hint: "
              "reshape sequence logits to [-1, C] and targets to [-1]",
              logits.shape(), target.shape());
  const int64_t classes = logits.size(-1), n = batched ? logits.size(0) : 1;
  WEAVE_CHECK(classes > 0 || n == 0, "cross_entropy", "logits {} have no classes", logits.shape());
  // A step captured in a CUDA graph cannot read the targets on the host: its replays count
  // them on the device and rely on the eager calls' checks.
  const bool on_host = !capturing_graph(target);
  const int64_t counted = on_host ? check_targets(target, classes, ignore_index) : 0;
  const DType out_dtype = to_floating(logits.dtype()), dtype = kernel_dtype(out_dtype);
  Tensor rows = convert(logits, dtype).contiguous().reshape({n, classes});
  Tensor t = convert(target, kInt64).contiguous().reshape({n});
  Tensor loss = empty_on({n}, dtype, logits.device()), lse = empty_on({n}, dtype, logits.device());
  kernels::cross_entropy(rows, t, ignore_index, loss, lse);
  // dlogits = g (softmax(logits) - onehot(target)), recomputed from the saved log-sum-exp
  // The per-row losses stay in the kernel's dtype until reduced (float32 for float16 logits).
  loss = autograd::record("CrossEntropyBackward", {logits}, loss, [&] {
    return [rs = SavedTensor(rows), t, lse, ignore_index,
            in = InputInfo(logits)](const BackwardArgs& args) -> Grads {
      Tensor rv = rs.unpack();
      Tensor g = convert(args.grad(), rv.dtype()).contiguous();
      Tensor d = empty_on(rv.shape(), rv.dtype(), rv.device());
      kernels::cross_entropy_backward(g, rv, t, ignore_index, lse, d);
      return {convert(d.reshape(in.shape), in.dtype)};
    };
  });
  if (!batched) loss = loss.reshape({});
  // The mean over the targets that count (NaN when every one is ignored, as in PyTorch).
  if (on_host || reduction != Reduction::Mean)
    return reduce_loss(loss, reduction, out_dtype, double(counted));
  Tensor wide = is_reduced_float(loss.dtype()) ? loss.to(kFloat32) : loss;
  Tensor count = sum(ne(t, wrap_scalar(double(ignore_index), t))).to(wide.dtype());
  return (sum(wide) / count).to(out_dtype);
}

Tensor mse_loss(const Tensor& input, const Tensor& target, Reduction reduction) {
  check_defined(input, "mse_loss", "input");
  check_defined(target, "mse_loss", "target");
  if (autocast_dtype()) {
    Tensor ic = autocast_input(input, "mse_loss", "input");
    Tensor tc = autocast_input(target, "mse_loss", "target");
    if (!ic.is_same(input) || !tc.is_same(target)) return mse_loss(ic, tc, reduction);
  }
  WEAVE_CHECK(input.shape() == target.shape(), "mse_loss",
              "input {} and target {} must have the same shape", input.shape(), target.shape());
  const DType out_dtype = promote_types(to_floating(input.dtype()), target.dtype());
  // Reduced, float16 differences are squared in float32 too: 300 squared is past its range.
  const bool widen = is_reduced_float(out_dtype) && reduction != Reduction::None;
  Tensor diff = widen ? input.to(kFloat32) - target.to(kFloat32) : floating(input) - target;
  return reduce_loss(diff * diff, reduction, out_dtype);
}

Tensor layer_norm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight,
                  const Tensor& bias, double eps) {
  return normalization("layer_norm", false, x, normalized_shape, weight, bias, eps);
}

Tensor rms_norm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight, double eps) {
  return normalization("rms_norm", true, x, normalized_shape, weight, Tensor(), eps);
}

Tensor bias_gelu(const Tensor& x, const Tensor& bias, bool tanh_approximation) {
  check_defined(x, "bias_gelu");
  if (!bias.defined()) return tanh_approximation ? gelu_tanh(x) : gelu(x);
  if (autocast_dtype()) {
    Tensor xc = autocast_input(x, "bias_gelu", "input");
    Tensor bc = autocast_input(bias, "bias_gelu", "bias");
    if (!xc.is_same(x) || !bc.is_same(bias)) return bias_gelu(xc, bc, tanh_approximation);
  }
  check_same_device(x, bias, "bias_gelu");
  WEAVE_CHECK(x.dim() >= 1 && bias.dim() == 1 && bias.size(0) == x.size(-1), "bias_gelu",
              "expected a bias of shape [{}] for input {}, found {}", x.dim() ? x.size(-1) : 0,
              x.shape(), bias.shape());
  const auto op = tanh_approximation ? kernels::UnaryOp::GeluTanh : kernels::UnaryOp::Gelu;
  // The kernel reads and writes the dtype itself (computing in float32): no conversion passes
  // over the largest activation of an MLP.
  const DType out_dtype = to_floating(promote_types(x.dtype(), bias.dtype()));
  const DType dtype = out_dtype;
  Tensor xc = convert(x, dtype), bc = convert(bias, dtype);
  Tensor y = empty_on(x.shape(), dtype, x.device());
  kernels::bias_activation(op, xc, broadcast_view(bc, x.shape()), y);
  // z = x + b: dx = g gelu'(z), db = dx summed over all but the last dim
  return autograd::record("BiasGeluBackward", {x, bias}, convert(y, out_dtype), [&] {
    return [xs = SavedTensor(xc), bs = SavedTensor(bc), op, xi = InputInfo(x),
            bi = InputInfo(bias)](const BackwardArgs& args) -> Grads {
      Tensor xv = xs.unpack();
      Tensor g = convert(args.grad(), xv.dtype());
      Tensor dz = empty_on(xv.shape(), xv.dtype(), xv.device());
      kernels::bias_activation_backward(op, g, xv, broadcast_view(bs.unpack(), xv.shape()), dz);
      return {args.needs(0) ? convert(dz, xi.dtype) : Tensor(),
              args.needs(1) ? reduce_grad(dz, bi) : Tensor()};
    };
  });
}

namespace {

// Half i (0: the gate, 1: up) of gate_up's last dim, as a view for the kernels (unrecorded).
Tensor half_of(const Tensor& gate_up, int64_t i) {
  Shape shape = gate_up.shape();
  const int64_t f = shape.back() / 2;
  shape[shape.size() - 1] = f;
  return make_view(gate_up, shape, gate_up.strides(),
                   gate_up.offset() + i * f * gate_up.strides().back());
}

// op(gate) * up over the two halves of one fused projection's output, in one pass each way.
Tensor gated(const Tensor& gate_up, kernels::UnaryOp op, const char* name) {
  check_defined(gate_up, name, "gate_up");
  WEAVE_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, name,
              "expected gate_up [..., 2F], the gate in its first half and up in its second, "
              "found {}; hint: one projection to 2F features, as Linear(d, 2 * F) gives",
              gate_up.shape());
  const DType out_dtype = to_floating(gate_up.dtype()), dtype = kernel_dtype(out_dtype);
  Tensor xc = convert(gate_up, dtype);
  Tensor y = empty_on(half_of(xc, 0).shape(), dtype, xc.device());
  kernels::gated_activation(op, half_of(xc, 0), half_of(xc, 1), y);
  return autograd::record("GatedActivationBackward", {gate_up}, convert(y, out_dtype), [&] {
    return [xs = SavedTensor(xc), op, in = InputInfo(gate_up)](const BackwardArgs& args) -> Grads {
      Tensor xv = xs.unpack();
      Tensor g = convert(args.grad(), xv.dtype());
      Tensor d = empty_on(xv.shape(), xv.dtype(), xv.device());  // [dgate | dup], one buffer
      kernels::gated_activation_backward(op, g, half_of(xv, 0), half_of(xv, 1), half_of(d, 0),
                                         half_of(d, 1));
      return {convert(d, in.dtype)};
    };
  });
}

}  // namespace

Tensor swiglu(const Tensor& gate_up) {
  return gated(gate_up, kernels::UnaryOp::Silu, "swiglu");
}

Tensor geglu(const Tensor& gate_up, bool tanh_approximation) {
  return gated(gate_up, tanh_approximation ? kernels::UnaryOp::GeluTanh : kernels::UnaryOp::Gelu,
               "geglu");
}

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  check_defined(weight, "embedding", "weight");
  check_defined(indices, "embedding", "indices");
  WEAVE_CHECK(weight.dim() == 2, "embedding", "expected a 2-D weight [num, dim], found {}",
              weight.shape());
  WEAVE_CHECK(indices.dtype() == kInt64 || indices.dtype() == kInt32, "embedding",
              "expected int32 or int64 indices, found {}", indices.dtype());
  Shape shape = indices.shape();
  shape.push_back(weight.size(1));
  // Ids are rows: -1 is no row (PyTorch raises too), not the last one.
  return detail::index_select_rows(weight, 0, indices.reshape({-1}), "embedding", false)
      .reshape(shape);
}

Tensor dropout(const Tensor& x, double p, bool training, Generator* generator) {
  check_defined(x, "dropout");
  WEAVE_CHECK(p >= 0.0 && p <= 1.0, "dropout", "probability must be in [0, 1], found {}", p);
  if (!training || p == 0.0) return x;
  if (p == 1.0) return x * 0.0;
  WEAVE_CHECK(!capturing_graph(x), "dropout",
              "draws its mask on the host, which a step captured in a CUDA graph cannot do (every "
              "replay would reuse one mask); hint: dropout 0 in captured steps");
  Tensor keep = ge(rand(x.shape(), {.dtype = kFloat32}, generator), scalar_tensor(p));
  Tensor scale = convert(keep, to_floating(x.dtype())).to(x.device()) / (1.0 - p);
  return x * scale;
}

}  // namespace weave
