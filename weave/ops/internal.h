#pragma once
// Helpers shared by the op front ends (not part of the public API). None of them records
// autograd: front ends record once, on their own inputs.
#include "weave/autograd/node.h"
#include "weave/kernels/kernels.h"
#include "weave/ops/ops.h"

namespace weave::detail {

using autograd::BackwardArgs;
using autograd::SavedTensor;
using Grads = std::vector<Tensor>;

inline Tensor empty_on(const Shape& shape, DType dtype, Device device) {
  return empty(shape, {.dtype = dtype, .device = device});
}

/// t converted to dtype; t itself when it already has it.
inline Tensor convert(const Tensor& t, DType dtype) {
  if (t.dtype() == dtype) return t;
  Tensor out = empty_on(t.shape(), dtype, t.device());
  kernels::copy(t, out);
  return out;
}

/// The dtype a fused kernel computes in: float64 stays, everything else runs in float32 (the
/// reduced-precision dtypes accumulate in float32 and are converted back).
inline DType kernel_dtype(DType dtype) {
  return dtype == kFloat64 ? kFloat64 : kFloat32;
}

/// A stride-0 view of t broadcast to shape (t's shape must broadcast to it).
Tensor broadcast_view(const Tensor& t, const Shape& shape);

/// Raises unless t is defined, naming op and argument.
inline void check_defined(const Tensor& t, const char* op, const char* what = "input") {
  WEAVE_CHECK(t.defined(), op, "{} is an undefined tensor", what);
}

inline void check_same_device(const Tensor& a, const Tensor& b, const char* op) {
  WEAVE_CHECK(a.device() == b.device(), op,
              "expected tensors on one device, found {} and {}; hint: move one with .to()",
              a.device(), b.device());
}

/// What every op that picks by an index tensor requires: x and an int32/int64 index, both
/// defined, on one device.
inline void check_index_args(const Tensor& x, const Tensor& index, const char* op) {
  check_defined(x, op);
  check_defined(index, op, "index");
  check_same_device(x, index, op);
  WEAVE_CHECK(index.dtype() == kInt64 || index.dtype() == kInt32, op,
              "expected an int32 or int64 index, found {}", index.dtype());
}

/// Per-position ids (rotary positions, document ids), int32 or int64 [length] or [batch,
/// length] on like's device, as an int64 [batch, length] view (broadcast over the batch);
/// raises naming op and what otherwise.
inline Tensor per_position(const Tensor& ids, int64_t batch, int64_t length, const Tensor& like,
                           const char* op, const char* what) {
  check_defined(ids, op, what);
  check_same_device(like, ids, op);
  WEAVE_CHECK(ids.dtype() == kInt64 || ids.dtype() == kInt32, op,
              "expected int32 or int64 {}, found {}", what, ids.dtype());
  WEAVE_CHECK((ids.dim() == 1 && ids.size(0) == length) ||
                  (ids.dim() == 2 && ids.size(0) == batch && ids.size(1) == length),
              op, "expected {} [{}] or [{}, {}] (one per position), found {}", what, length, batch,
              length, ids.shape());
  return broadcast_view(convert(ids, kInt64), {batch, length});
}

/// index as int64 with its negative entries counted from the end of a dimension of size n;
/// raises, naming op and dimension d, when an entry is outside [-n, n).
Tensor wrapped_index(const Tensor& index, int64_t n, int d, const char* op, bool wraps = true);
/// index_select's work under `op`'s name; without `wraps` a negative index raises (ids).
Tensor index_select_rows(const Tensor& x, int64_t dim, const Tensor& index, const char* op,
                         bool wraps);

/// Shape and dtype of an input whose values backward does not need.
struct InputInfo {
  Shape shape;
  DType dtype = kFloat32;
  InputInfo() = default;
  explicit InputInfo(const Tensor& t) {
    if (t.defined()) {
      shape = t.shape();
      dtype = t.dtype();
    }
  }
};

/// The gradient for an input from a gradient of broadcast shape: summed to the input's shape
/// and converted to its dtype.
inline Tensor reduce_grad(const Tensor& grad, const InputInfo& input) {
  return convert(sum_to(grad, input.shape), input.dtype);
}
inline Tensor reduce_grad(const Tensor& grad, const Tensor& input) {
  return reduce_grad(grad, InputInfo(input));
}

/// Dims list with every entry normalized and checked for duplicates; empty means all dims.
std::vector<bool> reduced_dims_mask(const Dims& dims, int rank, const char* op);

/// Marks a tensor written in place: bumps the version and, when autograd is involved,
/// moves the history of `result` (the out-of-place result) onto `self`.
void commit_inplace(Tensor& self, const Tensor& result);
/// True if an in-place op on self with these operands must be recorded; raises for the
/// in-place cases autograd cannot support (a leaf requiring grad, a view of one).
bool inplace_needs_autograd(const Tensor& self, const Tensor& other, const char* op);

}  // namespace weave::detail
