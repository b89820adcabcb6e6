// Neural-network ops: softmax family, losses, normalization, embedding, dropout.
#include "weave/autograd/grad_mode.h"
#include "weave/ops/internal.h"

namespace weave {

using namespace detail;

namespace {

Tensor floating(const Tensor& x) {
  return convert(x, to_floating(x.dtype()));
}

Tensor apply_reduction(const Tensor& loss, Reduction reduction) {
  switch (reduction) {
    case Reduction::Mean:
      return mean(loss);
    case Reduction::Sum:
      return sum(loss);
    case Reduction::None:
      return loss;
  }
  return loss;
}

}  // namespace

Tensor softmax(const Tensor& x, int64_t dim) {
  check_defined(x, "softmax");
  const int d = normalize_dim(dim, x.dim(), "softmax");
  Tensor xf = floating(x), y;
  {
    NoGradGuard no_grad;
    if (xf.numel() == 0) {  // nothing to normalize (an empty dim has no max)
      y = empty(xf.shape(), {.dtype = xf.dtype(), .device = xf.device()});
    } else {
      Tensor e = exp(xf - max(xf, {d}, true));
      y = e / sum(e, {d}, true);
    }
  }
  // dx = y (g - sum(g y))
  return autograd::record("SoftmaxBackward", {x}, y, [&] {
    return [ys = SavedTensor(y), d, in = InputInfo(x)](const BackwardArgs& args) -> Grads {
      Tensor yv = ys.unpack();
      const Tensor& g = args.grad();
      return {convert(yv * (g - sum(g * yv, {d}, true)), in.dtype)};
    };
  });
}

Tensor log_softmax(const Tensor& x, int64_t dim) {
  check_defined(x, "log_softmax");
  const int d = normalize_dim(dim, x.dim(), "log_softmax");
  Tensor xf = floating(x), y;
  {
    NoGradGuard no_grad;
    if (xf.numel() == 0) {  // nothing to normalize (an empty dim has no max)
      y = empty(xf.shape(), {.dtype = xf.dtype(), .device = xf.device()});
    } else {
      Tensor shifted = xf - max(xf, {d}, true);
      y = shifted - log(sum(exp(shifted), {d}, true));
    }
  }
  // dx = g - exp(y) sum(g)
  return autograd::record("LogSoftmaxBackward", {x}, y, [&] {
    return [ys = SavedTensor(y), d, in = InputInfo(x)](const BackwardArgs& args) -> Grads {
      const Tensor& g = args.grad();
      return {convert(g - exp(ys.unpack()) * sum(g, {d}, true), in.dtype)};
    };
  });
}

Tensor cross_entropy(const Tensor& logits, const Tensor& target, Reduction reduction) {
  check_defined(logits, "cross_entropy", "logits");
  check_defined(target, "cross_entropy", "target");
  check_same_device(logits, target, "cross_entropy");
  WEAVE_CHECK(target.dtype() == kInt64 || target.dtype() == kInt32, "cross_entropy",
              "expected integer class targets (int64 or int32), found {}", target.dtype());
  const bool batched = logits.dim() == 2;
  WEAVE_CHECK((batched && target.dim() == 1 && target.size(0) == logits.size(0)) ||
                  (logits.dim() == 1 && target.dim() == 0),
              "cross_entropy",
              "expected logits [N, C] with target [N] (or [C] with []), found {} and {}",
              logits.shape(), target.shape());
  const int64_t classes = logits.size(-1), n = batched ? logits.size(0) : 1;
  Tensor t = convert(target, kInt64).reshape({n});
  if (n > 0) {
    int64_t lo = min(t).item<int64_t>(), hi = max(t).item<int64_t>();
    WEAVE_CHECK(lo >= 0 && hi < classes, "cross_entropy",
                "target classes must lie in [0, {}), found values in [{}, {}]", classes, lo, hi);
  }
  Tensor logp = log_softmax(logits, -1).reshape({-1});
  Tensor rows = arange(0, static_cast<double>(n), 1, {.dtype = kInt64, .device = logits.device()});
  Tensor picked = index_select(logp, 0, rows * static_cast<double>(classes) + t);
  Tensor loss = -picked;
  if (!batched) loss = loss.reshape({});
  return apply_reduction(loss, reduction);
}

Tensor mse_loss(const Tensor& input, const Tensor& target, Reduction reduction) {
  check_defined(input, "mse_loss", "input");
  check_defined(target, "mse_loss", "target");
  WEAVE_CHECK(input.shape() == target.shape(), "mse_loss",
              "input {} and target {} must have the same shape", input.shape(), target.shape());
  Tensor diff = floating(input) - target;
  return apply_reduction(diff * diff, reduction);
}

Tensor layer_norm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight,
                  const Tensor& bias, double eps) {
  check_defined(x, "layer_norm");
  WEAVE_CHECK(eps >= 0 && std::isfinite(eps), "layer_norm",
              "eps must be a finite non-negative number, found {}", eps);
  const int k = normalized_shape.size();
  bool matches = k >= 1 && k <= x.dim();
  for (int i = 0; matches && i < k; ++i)
    matches = x.shape()[x.dim() - k + i] == normalized_shape[i];
  WEAVE_CHECK(matches, "layer_norm", "input {} does not end with normalized_shape {}", x.shape(),
              normalized_shape);
  if (weight.defined())
    WEAVE_CHECK(weight.shape() == normalized_shape, "layer_norm",
                "expected weight of shape {}, found {}", normalized_shape, weight.shape());
  if (bias.defined())
    WEAVE_CHECK(bias.shape() == normalized_shape, "layer_norm",
                "expected bias of shape {}, found {}", normalized_shape, bias.shape());
  Dims dims;
  for (int i = 0; i < k; ++i) dims.push_back(x.dim() - k + i);
  Tensor xf = floating(x);
  Tensor mu = mean(xf, dims, true);
  Tensor centered = xf - mu;
  Tensor variance = mean(centered * centered, dims, true);
  Tensor y = centered * rsqrt(variance + eps);
  if (weight.defined()) y = y * weight;
  if (bias.defined()) y = y + bias;
  return y;
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
  return index_select(weight, 0, indices.reshape({-1})).reshape(shape);
}

Tensor dropout(const Tensor& x, double p, bool training, Generator* generator) {
  check_defined(x, "dropout");
  WEAVE_CHECK(p >= 0.0 && p <= 1.0, "dropout", "probability must be in [0, 1], found {}", p);
  if (!training || p == 0.0) return x;
  if (p == 1.0) return x * 0.0;
  Tensor keep = ge(rand(x.shape(), {.dtype = kFloat32}, generator), scalar_tensor(p));
  Tensor scale = convert(keep, to_floating(x.dtype())).to(x.device()) / (1.0 - p);
  return x * scale;
}

}  // namespace weave
