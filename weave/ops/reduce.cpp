// Reductions over any set of dims, with keepdim.
#include "weave/ops/autocast.h"
#include "weave/ops/internal.h"

namespace weave {

using namespace detail;
using kernels::ReduceOp;

namespace detail {

std::vector<bool> reduced_dims_mask(const Dims& dims, int rank, const char* op) {
  std::vector<bool> mask(rank, dims.empty());
  for (int64_t d : dims) {
    int dim = normalize_dim(d, rank, op);
    if (rank == 0) continue;
    WEAVE_CHECK(!mask[dim], op, "dimension {} appears more than once in {}", dim, dims);
    mask[dim] = true;
  }
  return mask;
}

}  // namespace detail

namespace {

struct ReducePlan {
  Tensor input;  // contiguous, viewed as [outer, reduced, inner]
  int64_t outer = 1, reduced = 1, inner = 1;
  Shape kept_shape;      // reduced dims -> 1
  Shape squeezed_shape;  // reduced dims removed
};

ReducePlan plan(const Tensor& x, const std::vector<bool>& mask) {
  ReducePlan p;
  const Shape& shape = x.shape();
  int first = -1, last = -1;
  for (int d = 0; d < x.dim(); ++d) {
    p.kept_shape.push_back(mask[d] ? 1 : shape[d]);
    if (!mask[d]) p.squeezed_shape.push_back(shape[d]);
    if (mask[d] && shape[d] != 1) {
      if (first < 0) first = d;
      last = d;
    }
  }
  bool block = true;  // reduced dims (ignoring size 1) are consecutive
  for (int d = std::max(first, 0); d <= last; ++d) block = block && (mask[d] || shape[d] == 1);
  if (first < 0) {  // nothing of size > 1 to reduce
    p.input = x.contiguous();
    p.outer = x.numel();
    return p;
  }
  if (block && x.is_contiguous()) {
    p.input = x;
    for (int d = 0; d < first; ++d) p.outer *= shape[d];
    for (int d = first; d <= last; ++d) p.reduced *= shape[d];
    for (int d = last + 1; d < x.dim(); ++d) p.inner *= shape[d];
    return p;
  }
  Dims order;
  for (int d = 0; d < x.dim(); ++d)
    if (!mask[d]) order.push_back(d);
  for (int d = 0; d < x.dim(); ++d)
    if (mask[d]) order.push_back(d);
  Shape pshape;
  Strides pstrides;
  for (int64_t d : order) {
    pshape.push_back(shape[d]);
    pstrides.push_back(x.strides()[d]);
  }
  Tensor permuted = make_view(x, pshape, pstrides, x.offset());
  p.input = empty_on(pshape, x.dtype(), x.device());
  kernels::copy(permuted, p.input);
  for (int d = 0; d < x.dim(); ++d) (mask[d] ? p.reduced : p.outer) *= shape[d];
  return p;
}

Tensor run(ReduceOp op, const ReducePlan& p, DType out_dtype, bool keepdim) {
  Tensor out = empty_on(keepdim ? p.kept_shape : p.squeezed_shape, out_dtype, p.input.device());
  kernels::reduce(op, p.input, p.outer, p.reduced, p.inner, out);
  return out;
}

// The gradient of a reduction, broadcast back to the input's shape.
Tensor expand_back(const Tensor& grad, const Shape& kept_shape, const Shape& input_shape) {
  return broadcast_view(grad.reshape(kept_shape), input_shape);
}

Tensor extremum(const Tensor& x, const Dims& dims, bool keepdim, ReduceOp op, const char* name,
                const char* backward_name) {
  check_defined(x, name);
  WEAVE_CHECK(x.dtype() != kBool, name, "expected a numeric tensor, found bool");
  auto mask = reduced_dims_mask(dims, x.dim(), name);
  ReducePlan p = plan(x, mask);
  WEAVE_CHECK(p.reduced > 0, name, "cannot reduce an empty dimension (input shape {})", x.shape());
  Tensor y = run(op, p, x.dtype(), keepdim);
  // d max = g shared equally among the elements equal to the maximum
  return autograd::record(backward_name, {x}, y, [&] {
    return [xs = SavedTensor(x), ys = SavedTensor(y), kept = p.kept_shape,
            dims](const BackwardArgs& args) -> Grads {
      Tensor xv = xs.unpack();
      Tensor winners = convert(eq(xv, expand_back(ys.unpack(), kept, xv.shape())), xv.dtype());
      Tensor count = sum(winners, dims, true);
      return {expand_back(args.grad(), kept, xv.shape()) * winners / count};
    };
  });
}

Tensor arg_extremum(const Tensor& x, std::optional<int64_t> dim, bool keepdim, ReduceOp op,
                    const char* name) {
  check_defined(x, name);
  WEAVE_CHECK(x.numel() > 0, name, "cannot take {} of an empty tensor", name);
  if (!dim) {
    ReducePlan p;
    p.input = x.contiguous();
    p.reduced = x.numel();
    p.kept_shape = Dims::filled(x.dim(), 1);
    return run(op, p, kInt64, keepdim);
  }
  std::vector<bool> mask(x.dim(), false);
  if (x.dim() > 0)
    mask[normalize_dim(*dim, x.dim(), name)] = true;
  else
    normalize_dim(*dim, 0, name);
  ReducePlan p = plan(x, mask);
  if (p.reduced == 1 && p.inner == 1) {  // reducing a size-1 dim: every index is 0
    Tensor out = empty_on(keepdim ? p.kept_shape : p.squeezed_shape, kInt64, x.device());
    kernels::fill(out, 0);
    return out;
  }
  return run(op, p, kInt64, keepdim);
}

}  // namespace

Tensor sum(const Tensor& x, const Dims& dims, bool keepdim) {
  check_defined(x, "sum");
  if (Tensor xc = autocast_input(x, "sum"); !xc.is_same(x)) return sum(xc, dims, keepdim);
  auto mask = reduced_dims_mask(dims, x.dim(), "sum");
  const DType dtype = is_floating(x.dtype()) ? x.dtype() : kInt64;
  Tensor y = run(ReduceOp::Sum, plan(convert(x, dtype), mask), dtype, keepdim);
  // d sum = g broadcast over the reduced dims
  Shape kept;
  for (int d = 0; d < x.dim(); ++d) kept.push_back(mask[d] ? 1 : x.shape()[d]);
  return autograd::record("SumBackward", {x}, y, [&] {
    return [kept, info = InputInfo(x)](const BackwardArgs& args) -> Grads {
      return {convert(expand_back(args.grad(), kept, info.shape), info.dtype)};
    };
  });
}

Tensor mean(const Tensor& x, const Dims& dims, bool keepdim) {
  check_defined(x, "mean");
  if (Tensor xc = autocast_input(x, "mean"); !xc.is_same(x)) return mean(xc, dims, keepdim);
  auto mask = reduced_dims_mask(dims, x.dim(), "mean");
  int64_t count = 1;
  for (int d = 0; d < x.dim(); ++d)
    if (mask[d]) count *= x.shape()[d];
  // float16 and bfloat16 are summed and divided in float32, then rounded once: a float16 sum of
  // 70,000 ones is already infinite.
  if (is_reduced_float(x.dtype()))
    return (sum(x.to(kFloat32), dims, keepdim) / static_cast<double>(count)).to(x.dtype());
  Tensor xf = is_floating(x.dtype()) ? x : x.to(kFloat32);
  return sum(xf, dims, keepdim) / static_cast<double>(count);
}

Tensor max(const Tensor& x, const Dims& dims, bool keepdim) {
  return extremum(x, dims, keepdim, ReduceOp::Max, "max", "MaxBackward");
}
Tensor min(const Tensor& x, const Dims& dims, bool keepdim) {
  return extremum(x, dims, keepdim, ReduceOp::Min, "min", "MinBackward");
}
Tensor argmax(const Tensor& x, std::optional<int64_t> dim, bool keepdim) {
  return arg_extremum(x, dim, keepdim, ReduceOp::ArgMax, "argmax");
}
Tensor argmin(const Tensor& x, std::optional<int64_t> dim, bool keepdim) {
  return arg_extremum(x, dim, keepdim, ReduceOp::ArgMin, "argmin");
}

Tensor var(const Tensor& x, const Dims& dims, int64_t correction, bool keepdim) {
  check_defined(x, "var");
  if (Tensor xc = autocast_input(x, "var"); !xc.is_same(x))
    return var(xc, dims, correction, keepdim);
  auto mask = reduced_dims_mask(dims, x.dim(), "var");
  int64_t count = 1;
  for (int d = 0; d < x.dim(); ++d)
    if (mask[d]) count *= x.shape()[d];
  WEAVE_CHECK(count - correction > 0, "var",
              "{} elements with correction {} leave no degrees of freedom", count, correction);
  if (is_reduced_float(x.dtype()))  // squares overflow float16 long before the data does
    return var(x.to(kFloat32), dims, correction, keepdim).to(x.dtype());
  Tensor xf = is_floating(x.dtype()) ? x : x.to(kFloat32);
  Tensor centered = xf - mean(xf, dims, true);
  return sum(centered * centered, dims, keepdim) / static_cast<double>(count - correction);
}

Tensor sum_to(const Tensor& x, const Shape& shape) {
  if (x.shape() == shape) return x;
  const int lead = x.dim() - shape.size();
  WEAVE_CHECK(lead >= 0, "sum_to", "cannot sum shape {} down to the larger rank of {}", x.shape(),
              shape);
  Dims dims;
  for (int d = 0; d < x.dim(); ++d) {
    if (d < lead) {
      dims.push_back(d);
    } else {
      int64_t target = shape[d - lead];
      WEAVE_CHECK(target == x.shape()[d] || target == 1, "sum_to",
                  "shape {} does not broadcast to {}", shape, x.shape());
      if (target == 1 && x.shape()[d] != 1) dims.push_back(d);
    }
  }
  Tensor summed = dims.empty() ? x : sum(x, dims, true);
  return summed.reshape(shape);
}

}  // namespace weave
