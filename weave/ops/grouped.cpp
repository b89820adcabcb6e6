// grouped_linear: one projection per group of rows, one node for them all.
#include <numeric>
#include <vector>

#include "weave/autograd/grad_mode.h"
#include "weave/ops/autocast.h"
#include "weave/ops/internal.h"

namespace weave {

using namespace detail;

namespace {

constexpr const char* kGrouped = "grouped_linear";

// A contiguous [rows, cols] block starting at row `first` of a contiguous 2-D t, as the [1,
// rows, cols] operand the batched kernel takes.
Tensor block(const Tensor& t, int64_t first, int64_t rows) {
  const int64_t cols = t.size(1);
  return make_view(t, {1, rows, cols}, {rows * cols, cols, 1}, t.offset() + first * cols);
}

// The transpose of a contiguous [r, c] matrix (or of a block of one) as a column-major [1, c, r].
Tensor transposed(const Tensor& m) {
  const int64_t r = m.size(-2), c = m.size(-1);
  return make_view(m, {1, c, r}, {r * c, 1, c}, m.offset());
}

struct Groups {
  std::vector<int64_t> first;  // each group's first row
  int64_t out = 0, in = 0;
};

Groups check_groups(const Tensor& x, const std::vector<Tensor>& weights,
                    const std::vector<int64_t>& counts, const std::vector<Tensor>& biases) {
  check_defined(x, kGrouped);
  WEAVE_CHECK(x.dim() == 2, kGrouped, "expected rows x [R, in], found {}", x.shape());
  WEAVE_CHECK(!weights.empty() && counts.size() == weights.size(), kGrouped,
              "expected one row count per weight, found {} counts for {} weights", counts.size(),
              weights.size());
  WEAVE_CHECK(biases.empty() || biases.size() == weights.size(), kGrouped,
              "expected no biases or one per weight, found {} for {} weights", biases.size(),
              weights.size());
  Groups g;
  g.in = x.size(1);
  const Shape& shape = weights[0].defined() ? weights[0].shape() : Shape{};
  int64_t rows = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    check_defined(weights[i], kGrouped, "weight");
    check_same_device(x, weights[i], kGrouped);
    WEAVE_CHECK(weights[i].shape() == shape && shape.size() >= 2 && shape[shape.size() - 1] == g.in,
                kGrouped,
                "expected every weight [out..., {}] of one shape (weight 0's {}), found weight "
                "{} {}",
                g.in, shape, i, weights[i].shape());
    WEAVE_CHECK(counts[i] >= 0, kGrouped, "group {} has {} rows; expected 0 or more", i, counts[i]);
    g.first.push_back(rows);
    rows += counts[i];
  }
  WEAVE_CHECK(rows == x.size(0), kGrouped,
              "the groups count {} rows, but x has {}; hint: counts[i] is the number of rows "
              "weights[i] projects, in order",
              rows, x.size(0));
  g.out = shape.numel() / g.in;
  for (size_t i = 0; i < biases.size(); ++i) {
    check_defined(biases[i], kGrouped, "bias");
    check_same_device(x, biases[i], kGrouped);
    WEAVE_CHECK(biases[i].numel() == g.out, kGrouped,
                "expected biases of {} elements (the weights' outputs), found bias {} {}", g.out, i,
                biases[i].shape());
  }
  return g;
}

// x [R, in] (contiguous) by the groups' weights [out, in] (contiguous) into [R, out].
Tensor grouped_forward(const Tensor& x, const std::vector<Tensor>& w, const std::vector<Tensor>& b,
                       const std::vector<int64_t>& counts, const Groups& g) {
  Tensor out = empty_on({x.size(0), g.out}, x.dtype(), x.device());
  for (size_t i = 0; i < w.size(); ++i) {
    if (counts[i] == 0) continue;
    const Tensor rows = block(out, g.first[i], counts[i]);
    if (!b.empty()) kernels::copy(broadcast_view(b[i].reshape({1, 1, g.out}), rows.shape()), rows);
    kernels::matmul(block(x, g.first[i], counts[i]), transposed(w[i]), rows, !b.empty());
  }
  return out;
}

Tensor flat(const Tensor& t, DType dtype, const Shape& shape) {
  return convert(t, dtype).contiguous().reshape(shape);
}

}  // namespace

Tensor grouped_linear(const Tensor& x, const std::vector<Tensor>& weights,
                      const std::vector<int64_t>& counts, const std::vector<Tensor>& biases) {
  const Groups g = check_groups(x, weights, counts, biases);
  if (autocast_dtype()) {
    bool cast = false;
    const auto autocast_all = [&](const std::vector<Tensor>& ts, const char* what) {
      std::vector<Tensor> out;
      for (const Tensor& t : ts) {
        out.push_back(autocast_input(t, kGrouped, what));
        cast = cast || !out.back().is_same(t);
      }
      return out;
    };
    const Tensor xc = autocast_input(x, kGrouped);
    std::vector<Tensor> wc = autocast_all(weights, "weight"), bc = autocast_all(biases, "bias");
    if (cast || !xc.is_same(x)) return grouped_linear(xc, wc, counts, bc);
  }
  DType dtype = to_floating(x.dtype());
  for (const Tensor& w : weights) dtype = promote_types(dtype, w.dtype());
  for (const Tensor& b : biases) dtype = promote_types(dtype, b.dtype());
  const Tensor xc = convert(x, dtype).contiguous();
  std::vector<Tensor> wc, bc;
  for (const Tensor& w : weights) wc.push_back(flat(w, dtype, {g.out, g.in}));
  for (const Tensor& b : biases) bc.push_back(flat(b, dtype, {g.out}));
  Tensor y;
  {
    NoGradGuard no_grad;
    y = grouped_forward(xc, wc, bc, counts, g);
  }
  std::vector<Tensor> inputs{x};
  inputs.insert(inputs.end(), weights.begin(), weights.end());
  inputs.insert(inputs.end(), biases.begin(), biases.end());
  return autograd::record("GroupedLinearBackward", inputs, y, [&] {
    std::vector<SavedTensor> saved_w;
    for (const Tensor& w : wc) saved_w.emplace_back(w);
    return [xs = SavedTensor(xc), saved_w = std::move(saved_w), xi = InputInfo(x),
            wi = InputInfo(weights[0]), bi = InputInfo(biases.empty() ? Tensor() : biases[0]),
            biased = !biases.empty(), counts, g](const BackwardArgs& args) -> Grads {
      const Tensor grad = args.grad().contiguous();
      const size_t n = saved_w.size();
      Grads grads(1 + n * (biased ? 2 : 1));
      const Tensor xv = xs.unpack();
      if (args.needs(0)) {  // dx = g W, group by group
        Tensor dx = empty_on({grad.size(0), g.in}, grad.dtype(), grad.device());
        for (size_t i = 0; i < n; ++i)
          if (counts[i] > 0)
            kernels::matmul(block(grad, g.first[i], counts[i]),
                            saved_w[i].unpack().reshape({1, g.out, g.in}),
                            block(dx, g.first[i], counts[i]));
        grads[0] = convert(dx, xi.dtype);
      }
      for (size_t i = 0; i < n; ++i) {
        const Tensor rows = grad.narrow(0, g.first[i], counts[i]);
        if (args.needs(1 + i)) {  // dW = g^T x over the group's rows
          Tensor dw = empty_on({g.out, g.in}, grad.dtype(), grad.device());
          if (counts[i] > 0)
            kernels::matmul(transposed(block(grad, g.first[i], counts[i])),
                            block(xv, g.first[i], counts[i]), dw.reshape({1, g.out, g.in}));
          else
            kernels::fill(dw, 0);
          grads[1 + i] = convert(dw.reshape(wi.shape), wi.dtype);
        }
        if (biased && args.needs(1 + n + i))
          grads[1 + n + i] = convert(sum(rows, {0}).reshape(bi.shape), bi.dtype);
      }
      return grads;
    };
  });
}

Tensor gather_weighted_sum(const Tensor& rows, const Tensor& index, const Tensor& weight) {
  constexpr const char* op = "gather_weighted_sum";
  check_index_args(rows, index, op);
  check_defined(weight, op, "weight");
  check_same_device(rows, weight, op);
  WEAVE_CHECK(rows.dim() == 2 && index.dim() == 2 && weight.shape() == index.shape(), op,
              "expected rows [R, H], index [T, K] and weight [T, K], found {}, {} and {}",
              rows.shape(), index.shape(), weight.shape());
  const Tensor ic = convert(index, kInt64).contiguous();
  if (ic.numel() > 0) {
    const int64_t highest = max(ic).item<int64_t>();
    WEAVE_CHECK(highest < rows.size(0), op,
                "index {} is out of range for {} rows; hint: a negative index adds nothing",
                highest, rows.size(0));
  }
  const DType dtype = kernel_dtype(promote_types(rows.dtype(), weight.dtype()));
  const Tensor rc = convert(rows, dtype).contiguous(), wc = convert(weight, dtype).contiguous();
  Tensor out = empty_on({index.size(0), rows.size(1)}, dtype, rows.device());
  kernels::gather_weighted_sum(rc, ic, wc, out);
  out = convert(out, to_floating(rows.dtype()));
  return autograd::record("GatherWeightedSumBackward", {rows, weight}, out, [&] {
    return [rs = SavedTensor(rc), ws = SavedTensor(wc), index = ic, ri = InputInfo(rows),
            wi = InputInfo(weight), dtype](const BackwardArgs& args) -> Grads {
      const Tensor grad = convert(args.grad(), dtype).contiguous(), rows_value = rs.unpack();
      Tensor d_rows = empty_on(rows_value.shape(), dtype, grad.device());
      Tensor d_weight = empty_on(index.shape(), dtype, grad.device());
      kernels::gather_weighted_sum_backward(grad, rows_value, index, ws.unpack(), d_rows, d_weight);
      return {args.needs(0) ? convert(d_rows, ri.dtype) : Tensor(),
              args.needs(1) ? convert(d_weight, wi.dtype) : Tensor()};
    };
  });
}

}  // namespace weave
