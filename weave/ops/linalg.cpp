// matmul and linear.
#include <algorithm>
#include <numeric>
#include <optional>
#include <vector>

#include "weave/autograd/grad_mode.h"
#include "weave/ops/activation_checkpoint.h"
#include "weave/ops/autocast.h"
#include "weave/ops/internal.h"

namespace weave {

using namespace detail;

namespace {

DType matmul_dtype(const Tensor& a, const Tensor& b) {
  DType dtype = to_floating(promote_types(a.dtype(), b.dtype()));
  return dtype;
}

// The single stride of dims (outermost first) taken as one dim, if they fold into one: each
// stride is the next one's stride times its size, size-1 dims aside. 0 when every one has size 1.
std::optional<int64_t> folded_stride(const Tensor& t, const std::vector<int64_t>& dims) {
  int64_t stride = 0, expected = -1;  // the stride the next outer non-trivial dim must have
  for (auto d = dims.rbegin(); d != dims.rend(); ++d) {
    const int64_t size = t.shape()[int(*d)], step = t.strides()[int(*d)];
    if (size == 1) continue;
    if (expected >= 0 && step != expected) return std::nullopt;
    if (expected < 0) stride = step;
    expected = step * size;
  }
  return stride;
}

std::vector<int64_t> first_dims(int n) {
  std::vector<int64_t> dims(static_cast<size_t>(std::max(n, 0)));
  std::iota(dims.begin(), dims.end(), 0);
  return dims;
}

// An operand as a 3-D [batch, rows, cols] tensor the kernel accepts: inner stride 1 (row-major)
// or row stride 1 (column-major), batch dims folded into one (stride 0 when broadcast).
Tensor as_batched(const Tensor& t, const Shape& batch, int64_t batch_numel) {
  const int r = t.dim();
  const int64_t rows = t.shape()[r - 2], cols = t.shape()[r - 1];
  int64_t rs = t.strides()[r - 2], cs = t.strides()[r - 1];
  if (rows == 1) rs = cols;  // size-1 dims may carry any stride; pin them
  if (cols == 1) cs = 1;
  const bool row_major = cs == 1 && rs >= cols;
  const bool col_major = rs == 1 && cs >= rows;
  Shape own_batch;
  for (int d = 0; d < r - 2; ++d) own_batch.push_back(t.shape()[d]);
  // Batch stride: 0 if t has no batch of its own, the single stride if it folds to one dim.
  std::optional<int64_t> batch_stride;
  if (own_batch.numel() == 1 || own_batch == batch)
    batch_stride = folded_stride(t, first_dims(r - 2));
  if ((row_major || col_major) && batch_stride)
    return make_view(t, {batch_numel, rows, cols}, {*batch_stride, rs, cs}, t.offset());
  Shape full = batch;
  full.push_back(rows);
  full.push_back(cols);
  Tensor dense = empty_on(full, t.dtype(), t.device());
  kernels::copy(broadcast_view(t, full), dense);
  return make_view(dense, {batch_numel, rows, cols}, {rows * cols, cols, 1}, 0);
}

// a [..., M, K] @ b [..., K, N] with broadcast batch dims; records nothing.
// a @ b (+ bias, broadcast over the rows: placed in the output first, then the GEMM adds onto
// it, which saves linear a separate pass over its output).
Tensor matmul_compute(const Tensor& a, const Tensor& b, const Tensor& bias = {}) {
  const int64_t m = a.size(-2), k = a.size(-1), n = b.size(-1);
  WEAVE_CHECK(b.size(-2) == k, "matmul", "inner dimensions differ: lhs {} vs rhs {}", a.shape(),
              b.shape());
  Shape batch_a, batch_b;
  for (int d = 0; d < a.dim() - 2; ++d) batch_a.push_back(a.shape()[d]);
  for (int d = 0; d < b.dim() - 2; ++d) batch_b.push_back(b.shape()[d]);
  Shape batch = broadcast_shapes(batch_a, batch_b, "matmul");
  const int64_t batch_numel = batch.numel();
  Shape out_shape = batch;
  out_shape.push_back(m);
  out_shape.push_back(n);
  Tensor out = empty_on(out_shape, a.dtype(), a.device());
  if (out.numel() == 0) return out;
  if (bias.defined())
    kernels::copy(broadcast_view(bias, out_shape), out);
  else if (k == 0)
    kernels::fill(out, 0);
  if (k == 0) return out;
  kernels::matmul(as_batched(a, batch, batch_numel), as_batched(b, batch, batch_numel),
                  make_view(out, {batch_numel, m, n}, {m * n, n, 1}, 0), bias.defined());
  return out;
}

// For linear's input x [..., K]: an order of the leading dims under which they fold into one
// (largest stride first), so that a permuted view, such as the [T, B, K] transpose of a
// contiguous [B, T, K], multiplies as one [M, K] matrix without a copy. Empty when they already
// fold in their own order (reshape makes the view) or fold in no order (reshape copies).
std::vector<int64_t> fold_order(const Tensor& x) {
  const int lead = x.dim() - 1;
  std::vector<int64_t> order = first_dims(lead);
  if (lead < 2 || folded_stride(x, order)) return {};
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return x.strides()[int(a)] > x.strides()[int(b)]; });
  if (!folded_stride(x, order)) return {};
  order.push_back(lead);
  return order;
}

std::vector<int64_t> inverse_order(const std::vector<int64_t>& order) {
  std::vector<int64_t> inverse(order.size());
  for (size_t i = 0; i < order.size(); ++i) inverse[size_t(order[i])] = int64_t(i);
  return inverse;
}

// t laid out in `order` (empty: as it is) as [-1, cols]: a view where the layout allows.
Tensor fold_rows(const Tensor& t, const std::vector<int64_t>& order, int64_t cols) {
  const Tensor permuted = order.empty() ? t : t.permute(Dims(order));
  return permuted.dim() == 2 ? permuted : permuted.reshape({-1, cols});
}

// rows [M, cols] back to the shape `like` has, undoing `order`.
Tensor unfold_rows(const Tensor& rows, const Shape& like, const std::vector<int64_t>& order) {
  Shape permuted = like;
  if (!order.empty())
    for (size_t i = 0; i < order.size(); ++i) permuted[int(i)] = like[int(order[i])];
  permuted[permuted.size() - 1] = rows.size(1);
  Tensor out = rows.reshape(permuted);
  return order.empty() ? out : out.permute(Dims(inverse_order(order)));
}

}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b) {
  check_defined(a, "matmul", "lhs");
  check_defined(b, "matmul", "rhs");
  check_same_device(a, b, "matmul");
  if (autocast_dtype()) {
    Tensor ac = autocast_input(a, "matmul", "lhs"), bc = autocast_input(b, "matmul", "rhs");
    if (!ac.is_same(a) || !bc.is_same(b)) return matmul(ac, bc);
  }
  WEAVE_CHECK(a.dim() >= 1 && b.dim() >= 1, "matmul",
              "both operands need at least 1 dimension, found {} and {}", a.shape(), b.shape());
  const bool a_vector = a.dim() == 1, b_vector = b.dim() == 1;
  if (a_vector || b_vector) {
    Tensor out = matmul(a_vector ? a.unsqueeze(0) : a, b_vector ? b.unsqueeze(-1) : b);
    if (b_vector) out = out.squeeze(-1);
    if (a_vector) out = out.squeeze(b_vector ? -1 : -2);
    return out;
  }
  const DType dtype = matmul_dtype(a, b);
  Tensor ac = convert(a, dtype), bc = convert(b, dtype);
  Tensor out = autograd::detail::kept_result("matmul", [&] { return matmul_compute(ac, bc); });
  // d(AB) = (G B^T, A^T G), summed over broadcast batch dims
  return autograd::record("MatmulBackward", {a, b}, out, [&] {
    return [as = SavedTensor(ac), bs = SavedTensor(bc), ai = InputInfo(a),
            bi = InputInfo(b)](const BackwardArgs& args) -> Grads {
      const Tensor& g = args.grad();
      Tensor av = as.unpack(), bv = bs.unpack();
      return {args.needs(0) ? reduce_grad(matmul_compute(g, bv.transpose(-1, -2)), ai) : Tensor(),
              args.needs(1) ? reduce_grad(matmul_compute(av.transpose(-1, -2), g), bi) : Tensor()};
    };
  });
}

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  check_defined(x, "linear");
  check_defined(weight, "linear", "weight");
  check_same_device(x, weight, "linear");
  if (autocast_dtype()) {
    Tensor xc = autocast_input(x, "linear"), wc = autocast_input(weight, "linear", "weight");
    Tensor bc = autocast_input(bias, "linear", "bias");
    if (!xc.is_same(x) || !wc.is_same(weight) || (bias.defined() && !bc.is_same(bias)))
      return linear(xc, wc, bc);
  }
  WEAVE_CHECK(weight.dim() == 2, "linear", "expected a 2-D weight [out, in], found {}",
              weight.shape());
  WEAVE_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1), "linear",
              "input features differ: input {} vs weight {} (expected [..., {}])", x.shape(),
              weight.shape(), weight.size(1));
  if (bias.defined()) {
    check_same_device(x, bias, "linear");
    WEAVE_CHECK(bias.dim() == 1 && bias.size(0) == weight.size(0), "linear",
                "expected a bias of shape [{}], found {}", weight.size(0), bias.shape());
  }
  DType dtype = matmul_dtype(x, weight);
  if (bias.defined()) dtype = promote_types(dtype, bias.dtype());
  Tensor xc = convert(x, dtype), wc = convert(weight, dtype);
  const std::vector<int64_t> order = fold_order(xc);
  Tensor x2 = fold_rows(xc, order, x.size(-1));
  Tensor y;
  {
    NoGradGuard no_grad;
    y = unfold_rows(autograd::detail::kept_result(
                        "matmul",
                        [&] {
                          return matmul_compute(x2, wc.t(),
                                                bias.defined() ? convert(bias, dtype) : Tensor());
                        }),
                    x.shape(), order);
  }
  // dx = G W, dW = G^T x, db = sum of G over all but the last dim (G in x's row order)
  return autograd::record("LinearBackward", {x, weight, bias}, y, [&] {
    return [xs = SavedTensor(x2), ws = SavedTensor(wc), xi = InputInfo(x), wi = InputInfo(weight),
            bi = InputInfo(bias), order](const BackwardArgs& args) -> Grads {
      Tensor g = fold_rows(args.grad(), order, args.grad().size(-1));
      Tensor dx, dw, db;
      if (args.needs(0))
        dx = convert(unfold_rows(matmul_compute(g, ws.unpack()), xi.shape, order), xi.dtype);
      if (args.needs(1)) dw = convert(matmul_compute(g.t(), xs.unpack()), wi.dtype);
      if (args.needs(2)) db = convert(sum(g, {0}), bi.dtype);
      return {dx, dw, db};
    };
  });
}

}  // namespace weave
