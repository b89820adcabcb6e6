// Masking, selection and sampling: tril/triu, masked_fill, gather/take_along_dim, topk,
// multinomial. The masks are built from index comparisons and applied by `where` (so they
// differentiate like it); gather and topk pick their values with a differentiable index_select
// of flat positions (its backward adds into the picked places, on any device); topk and
// multinomial decide on the host.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "weave/ops/internal.h"

namespace weave {

using namespace detail;

namespace {

// Keeps the elements whose col - row satisfies keep(col - row) over the last two dims.
Tensor triangle(const Tensor& x, int64_t diagonal, bool lower, const char* op) {
  check_defined(x, op);
  WEAVE_CHECK(x.dim() >= 2, op, "expected a tensor of at least 2 dims, found {}", x.shape());
  const int64_t rows = x.size(-2), cols = x.size(-1);
  const TensorOptions index{.dtype = kInt64, .device = x.device()};
  Tensor offset = arange(0, double(cols), 1, index).reshape({1, cols}) -
                  arange(0, double(rows), 1, index).reshape({rows, 1});
  Tensor keep = lower ? le(offset, scalar_tensor(double(diagonal), index))
                      : ge(offset, scalar_tensor(double(diagonal), index));
  return where(keep, x, zeros({}, {.dtype = x.dtype(), .device = x.device()}));
}

}  // namespace

Tensor tril(const Tensor& x, int64_t diagonal) {
  return triangle(x, diagonal, true, "tril");
}

Tensor triu(const Tensor& x, int64_t diagonal) {
  return triangle(x, diagonal, false, "triu");
}

Tensor masked_fill(const Tensor& x, const Tensor& mask, double value) {
  check_defined(x, "masked_fill");
  check_defined(mask, "masked_fill", "mask");
  check_same_device(x, mask, "masked_fill");
  WEAVE_CHECK(mask.dtype() == kBool, "masked_fill",
              "expected a bool mask, found {}; hint: compare to build one (x > 0)", mask.dtype());
  WEAVE_CHECK(broadcast_shapes(x.shape(), mask.shape(), "masked_fill") == x.shape(), "masked_fill",
              "mask {} does not broadcast to the input's shape {}", mask.shape(), x.shape());
  return where(mask, wrap_scalar(value, x), x);
}

TopK topk(const Tensor& x, int64_t k, int64_t dim, bool largest) {
  check_defined(x, "topk");
  const int d = normalize_dim(dim, x.dim(), "topk");
  const int64_t n = x.dim() == 0 ? 1 : x.size(d);
  WEAVE_CHECK(k >= 0 && k <= n, "topk", "k = {} is out of range for a dimension of size {}", k, n);
  // Rows along the last dim; the order is decided on the host in float64 (exact for every
  // dtype but int64 beyond 2^53, whose order it keeps up to rounding).
  Tensor moved = x.dim() == 0 ? x.reshape({1}) : x.transpose(d, -1);
  Tensor host = moved.detach().to(kCPU).to(kFloat64).contiguous();
  const int64_t rows = n == 0 ? 0 : host.numel() / n;
  const double* v = host.data<double>();
  std::vector<int64_t> picked(static_cast<size_t>(rows * k)), local(picked.size()),
      order(static_cast<size_t>(n));
  for (int64_t r = 0; r < rows; ++r) {
    const double* row = v + r * n;
    std::iota(order.begin(), order.end(), int64_t(0));
    // NaN ranks above everything (largest) or below (smallest); ties keep the lower index.
    auto before = [&](int64_t a, int64_t b) {
      const double va = row[a], vb = row[b];
      const bool na = std::isnan(va), nb = std::isnan(vb);
      if (na || nb) return largest ? na && !nb : nb && !na;
      return largest ? va > vb : va < vb;
    };
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) {
      return before(a, b) || (!before(b, a) && a < b);
    });
    for (int64_t i = 0; i < k; ++i) {
      local[size_t(r * k + i)] = order[size_t(i)];
      picked[size_t(r * k + i)] = r * n + order[size_t(i)];
    }
  }
  Shape out_shape = moved.shape();
  out_shape[out_shape.size() - 1] = k;
  Tensor flat_index = from_vector(picked, {rows * k}).to(x.device());
  Tensor values = index_select(moved.reshape({-1}), 0, flat_index).reshape(out_shape);
  Tensor indices = from_vector(local, out_shape).to(x.device());
  if (x.dim() == 0) return {values.reshape({}), indices.reshape({})};
  return {values.transpose(d, -1), indices.transpose(d, -1)};
}

Tensor gather(const Tensor& x, int64_t dim, const Tensor& index) {
  check_index_args(x, index, "gather");
  WEAVE_CHECK(index.dim() == x.dim(), "gather",
              "expected an index with x's {} dims, found shape {} for x of shape {}; hint: "
              "unsqueeze the index, or use take_along_dim, which broadcasts",
              x.dim(), index.shape(), x.shape());
  if (x.dim() == 0) return gather(x.reshape({1}), 0, index.reshape({1})).reshape({});
  const int d = normalize_dim(dim, x.dim(), "gather");
  for (int k = 0; k < x.dim(); ++k)
    WEAVE_CHECK(k == d || index.size(k) <= x.size(k), "gather",
                "index shape {} exceeds x's shape {} in dimension {} (only dimension {} may be "
                "larger)",
                index.shape(), x.shape(), k, d);
  const int64_t n = x.size(d);
  const Tensor idx = wrapped_index(index, n, d, "gather");
  // The flat position in contiguous x of every index element: its own coordinates, with the
  // index value along d.
  std::vector<int64_t> stride(size_t(x.dim()), 1);  // of contiguous x
  for (int k = x.dim() - 2; k >= 0; --k) stride[size_t(k)] = stride[size_t(k + 1)] * x.size(k + 1);
  Tensor flat = idx * wrap_scalar(double(stride[size_t(d)]), idx);
  for (int k = 0; k < x.dim(); ++k) {
    if (k == d) continue;
    Shape along = Shape::filled(x.dim(), 1);
    along[k] = index.size(k);
    const Tensor at = arange(double(index.size(k)), {.dtype = kInt64, .device = x.device()});
    flat = flat + at.reshape(along) * wrap_scalar(double(stride[size_t(k)]), idx);
  }
  return index_select(x.contiguous().reshape({-1}), 0, flat.contiguous().reshape({-1}))
      .reshape(index.shape());
}

Tensor take_along_dim(const Tensor& x, const Tensor& indices, int64_t dim) {
  check_defined(x, "take_along_dim");
  check_defined(indices, "take_along_dim", "indices");
  WEAVE_CHECK(indices.dim() == x.dim(), "take_along_dim",
              "expected indices with x's {} dims, found shape {} for x of shape {}", x.dim(),
              indices.shape(), x.shape());
  if (x.dim() == 0) return gather(x, 0, indices);
  const int d = normalize_dim(dim, x.dim(), "take_along_dim");
  // Broadcast every dimension but d; along d, x keeps its size and indices theirs.
  Shape x_shape = x.shape(), index_shape = indices.shape();
  x_shape[d] = index_shape[d] = 1;
  const Shape both = broadcast_shapes(x_shape, index_shape, "take_along_dim");
  x_shape = index_shape = both;
  x_shape[d] = x.size(d);
  index_shape[d] = indices.size(d);
  return gather(x.expand(x_shape), d, indices.expand(index_shape));
}

Tensor multinomial(const Tensor& probs, int64_t num_samples, bool replacement,
                   Generator* generator) {
  check_defined(probs, "multinomial", "probs");
  WEAVE_CHECK(probs.dim() == 1 || probs.dim() == 2, "multinomial",
              "expected probabilities [C] or [N, C], found {}", probs.shape());
  WEAVE_CHECK(is_floating(probs.dtype()), "multinomial",
              "expected floating probabilities, found {}", probs.dtype());
  const int64_t classes = probs.size(-1), rows = probs.dim() == 2 ? probs.size(0) : 1;
  WEAVE_CHECK(num_samples > 0, "multinomial", "num_samples must be positive, found {}",
              num_samples);
  WEAVE_CHECK(replacement || num_samples <= classes, "multinomial",
              "cannot draw {} samples without replacement from {} classes", num_samples, classes);
  Tensor host = probs.detach().to(kCPU).to(kFloat64).contiguous();
  const double* p = host.data<double>();
  Generator& g = generator ? *generator : default_generator();
  std::vector<int64_t> out(static_cast<size_t>(rows * num_samples));
  std::vector<double> weights(static_cast<size_t>(classes));
  for (int64_t r = 0; r < rows; ++r) {
    int64_t positive = 0;
    for (int64_t c = 0; c < classes; ++c) {
      const double w = p[r * classes + c];
      WEAVE_CHECK(std::isfinite(w) && w >= 0, "multinomial",
                  "probabilities must be finite and non-negative, found {} in row {}", w, r);
      weights[size_t(c)] = w;
      positive += w > 0;
    }
    WEAVE_CHECK(positive > 0, "multinomial", "row {} has no positive probability", r);
    WEAVE_CHECK(replacement || num_samples <= positive, "multinomial",
                "cannot draw {} samples without replacement from row {}, which has {} classes "
                "of positive probability",
                num_samples, r, positive);
    for (int64_t s = 0; s < num_samples; ++s) {
      const double total = std::accumulate(weights.begin(), weights.end(), 0.0);
      const double u = g.uniform() * total;
      double running = 0;
      int64_t chosen = -1;
      for (int64_t c = 0; c < classes; ++c) {
        if (weights[size_t(c)] <= 0) continue;
        chosen = c;  // the last positive class absorbs rounding at the top end
        running += weights[size_t(c)];
        if (u < running) break;
      }
      out[size_t(r * num_samples + s)] = chosen;
      if (!replacement) weights[size_t(chosen)] = 0;
    }
  }
  Shape shape = probs.dim() == 2 ? Shape{rows, num_samples} : Shape{num_samples};
  return from_vector(out, shape).to(probs.device());
}

}  // namespace weave
