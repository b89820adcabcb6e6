// Shape ops: views (reshape, permute, slice, expand, ...) and the copying joins and splits.
#include <numeric>

#include "weave/ops/captured_step.h"
#include "weave/ops/internal.h"

namespace weave {

using namespace detail;

namespace {

// A view of x recorded with `backward` (the views' gradients undo the reshaping).
Tensor view_of(const Tensor& x, const Shape& shape, const Strides& strides, int64_t offset,
               const char* backward_name, autograd::BackwardFn backward) {
  return autograd::record(backward_name, {x}, make_view(x, shape, strides, offset),
                          std::move(backward));
}

Shape infer_shape(const Shape& requested, int64_t numel, const char* op) {
  Shape shape = requested;
  int infer = -1;
  int64_t known = 1;
  for (int i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      WEAVE_CHECK(infer < 0, op, "only one dimension can be -1, found {}", requested);
      infer = i;
    } else {
      WEAVE_CHECK(shape[i] >= 0, op, "invalid size {} in {}", shape[i], requested);
      known *= shape[i];
    }
  }
  if (infer >= 0) {
    WEAVE_CHECK(known != 0 && numel % known == 0, op, "shape {} is invalid for input of size {}",
                requested, numel);
    shape[infer] = numel / known;
  }
  WEAVE_CHECK(shape.numel() == numel, op, "shape {} is invalid for input of size {}", requested,
              numel);
  return shape;
}

// Strides that let `shape` view memory laid out as (old_shape, old_strides), if any exist.
std::optional<Strides> view_strides(const Shape& old_shape, const Strides& old_strides,
                                    const Shape& shape) {
  if (old_shape.numel() == 0 || old_shape.size() == 0) return contiguous_strides(shape);
  Strides strides = Dims::filled(shape.size(), 0);
  int view_d = shape.size() - 1;
  int64_t chunk_base_stride = old_strides.back();
  int64_t tensor_numel = 1, view_numel = 1;
  for (int d = old_shape.size() - 1; d >= 0; --d) {
    tensor_numel *= old_shape[d];
    // End of a chunk of dims that are contiguous with each other?
    if (d == 0 ||
        (old_shape[d - 1] != 1 && old_strides[d - 1] != tensor_numel * chunk_base_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || shape[view_d] == 1)) {
        strides[view_d] = view_numel * chunk_base_stride;
        view_numel *= shape[view_d];
        --view_d;
      }
      if (view_numel != tensor_numel) return std::nullopt;
      if (d > 0) {
        chunk_base_stride = old_strides[d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  if (view_d != -1) return std::nullopt;
  return strides;
}

Tensor reshape_impl(const Tensor& x, const Shape& requested, bool allow_copy, const char* op) {
  check_defined(x, op);
  Shape shape = infer_shape(requested, x.numel(), op);
  auto strides = view_strides(x.shape(), x.strides(), shape);
  if (!strides) {
    WEAVE_CHECK(allow_copy, op,
                "a tensor of shape {} and strides {} cannot be viewed as {}; hint: use reshape() "
                "or contiguous() first",
                x.shape(), x.strides(), shape);
    return reshape_impl(x.contiguous(), shape, false, op);
  }
  // d reshape = g reshaped back
  return view_of(
      x, shape, *strides, x.offset(), "ReshapeBackward",
      [in = x.shape()](const BackwardArgs& args) -> Grads { return {args.grad().reshape(in)}; });
}

}  // namespace

Tensor reshape(const Tensor& x, const Shape& shape) {
  return reshape_impl(x, shape, true, "reshape");
}
Tensor view(const Tensor& x, const Shape& shape) {
  return reshape_impl(x, shape, false, "view");
}

Tensor flatten(const Tensor& x, int64_t start_dim, int64_t end_dim) {
  check_defined(x, "flatten");
  if (x.dim() == 0) return x.reshape({1});
  int start = normalize_dim(start_dim, x.dim(), "flatten");
  int end = normalize_dim(end_dim, x.dim(), "flatten");
  WEAVE_CHECK(start <= end, "flatten", "start_dim {} comes after end_dim {}", start, end);
  Shape shape;
  for (int d = 0; d < start; ++d) shape.push_back(x.shape()[d]);
  int64_t merged = 1;
  for (int d = start; d <= end; ++d) merged *= x.shape()[d];
  shape.push_back(merged);
  for (int d = end + 1; d < x.dim(); ++d) shape.push_back(x.shape()[d]);
  return x.reshape(shape);
}

Tensor permute(const Tensor& x, const Dims& order) {
  check_defined(x, "permute");
  WEAVE_CHECK(order.size() == x.dim(), "permute", "expected {} dims in the order, found {}",
              x.dim(), order);
  Shape shape;
  Strides strides;
  Dims inverse = Dims::filled(x.dim(), -1);
  for (int i = 0; i < order.size(); ++i) {
    int d = normalize_dim(order[i], x.dim(), "permute");
    WEAVE_CHECK(inverse[d] < 0, "permute", "dimension {} repeats in {}", d, order);
    inverse[d] = i;
    shape.push_back(x.shape()[d]);
    strides.push_back(x.strides()[d]);
  }
  // d permute = g permuted by the inverse order
  return view_of(
      x, shape, strides, x.offset(), "PermuteBackward",
      [inverse](const BackwardArgs& args) -> Grads { return {args.grad().permute(inverse)}; });
}

Tensor transpose(const Tensor& x, int64_t dim0, int64_t dim1) {
  check_defined(x, "transpose");
  if (x.dim() == 0) return x;
  Dims order;
  for (int d = 0; d < x.dim(); ++d) order.push_back(d);
  std::swap(order[normalize_dim(dim0, x.dim(), "transpose")],
            order[normalize_dim(dim1, x.dim(), "transpose")]);
  return permute(x, order);
}

Tensor slice(const Tensor& x, int64_t dim, int64_t start, int64_t end, int64_t step) {
  check_defined(x, "slice");
  WEAVE_CHECK(x.dim() > 0, "slice", "cannot slice a 0-d tensor");
  int d = normalize_dim(dim, x.dim(), "slice");
  WEAVE_CHECK(step > 0, "slice", "step must be positive, found {}", step);
  const int64_t size = x.shape()[d];
  if (start < 0) start += size;
  if (end < 0) end += size;
  start = std::clamp<int64_t>(start, 0, size);
  end = std::clamp<int64_t>(end, start, size);
  Shape shape = x.shape();
  Strides strides = x.strides();
  // Written so that no intermediate exceeds size: step may be as large as INT64_MAX.
  shape[d] = end == start ? 0 : (end - start - 1) / step + 1;
  int64_t stride = 0;
  WEAVE_CHECK(shape[d] <= 1 || !__builtin_mul_overflow(strides[d], step, &stride), "slice",
              "step {} times stride {} overflows int64", step, strides[d]);
  if (shape[d] > 1) strides[d] = stride;
  // d slice = g placed into zeros at the sliced positions
  return view_of(x, shape, strides, x.offset() + start * x.strides()[d], "SliceBackward",
                 [in = InputInfo(x), d, start, end, step](const BackwardArgs& args) -> Grads {
                   Tensor gx = zeros(
                       in.shape, {.dtype = args.grad().dtype(), .device = args.grad().device()});
                   gx.slice(d, start, end, step).copy_(args.grad());
                   return {gx};
                 });
}

Tensor narrow(const Tensor& x, int64_t dim, int64_t start, int64_t length) {
  check_defined(x, "narrow");
  WEAVE_CHECK(x.dim() > 0, "narrow", "cannot narrow a 0-d tensor");
  int d = normalize_dim(dim, x.dim(), "narrow");
  const int64_t size = x.shape()[d];
  if (start < 0) start += size;
  WEAVE_CHECK(start >= 0 && start <= size && length >= 0 && length <= size - start, "narrow",
              "start {} and length {} are outside dimension {} of size {}", start, length, d, size);
  return slice(x, d, start, start + length);
}

Tensor select(const Tensor& x, int64_t dim, int64_t index) {
  check_defined(x, "select");
  WEAVE_CHECK(x.dim() > 0, "select", "cannot select from a 0-d tensor");
  int d = normalize_dim(dim, x.dim(), "select");
  const int64_t size = x.shape()[d];
  WEAVE_CHECK(index >= -size && index < size, "select",
              "index {} is out of range for dimension {} of size {}", index, d, size);
  if (index < 0) index += size;
  return narrow(x, d, index, 1).squeeze(d);
}

Tensor expand(const Tensor& x, const Shape& requested) {
  check_defined(x, "expand");
  WEAVE_CHECK(requested.size() >= x.dim(), "expand",
              "target shape {} has fewer dimensions than the input {}", requested, x.shape());
  const int lead = requested.size() - x.dim();
  Shape shape = requested;
  Strides strides = Dims::filled(shape.size(), 0);
  for (int i = 0; i < shape.size(); ++i) {
    if (i < lead) {
      WEAVE_CHECK(shape[i] >= 0, "expand", "new leading dimension {} cannot be {}", i, shape[i]);
      continue;
    }
    int64_t have = x.shape()[i - lead];
    if (shape[i] == -1) shape[i] = have;
    WEAVE_CHECK(shape[i] >= 0, "expand",
                "cannot expand {} to {}: dimension {} is {}; sizes are non-negative (or -1 to keep "
                "one)",
                x.shape(), requested, i, shape[i]);
    WEAVE_CHECK(have == shape[i] || have == 1, "expand",
                "cannot expand {} to {}: dimension {} is {}, expected 1 or {}", x.shape(),
                requested, i, have, shape[i]);
    strides[i] = have == shape[i] ? x.strides()[i - lead] : 0;
  }
  shape.numel();  // raises if the expanded element count overflows
  // d expand = g summed over the broadcast dims
  return view_of(
      x, shape, strides, x.offset(), "ExpandBackward",
      [in = x.shape()](const BackwardArgs& args) -> Grads { return {sum_to(args.grad(), in)}; });
}

Tensor squeeze(const Tensor& x, std::optional<int64_t> dim) {
  check_defined(x, "squeeze");
  Shape shape;
  std::optional<int> only;
  if (dim) only = normalize_dim(*dim, x.dim(), "squeeze");
  for (int d = 0; d < x.dim(); ++d) {
    bool drop = x.shape()[d] == 1 && (!only || *only == d);
    if (!drop) shape.push_back(x.shape()[d]);
  }
  return x.reshape(shape);
}

Tensor unsqueeze(const Tensor& x, int64_t dim) {
  check_defined(x, "unsqueeze");
  int d = normalize_dim(dim, x.dim() + 1, "unsqueeze");
  Shape shape = x.shape();
  shape.insert(d, 1);
  return x.reshape(shape);
}

Tensor cat(const std::vector<Tensor>& tensors, int64_t dim) {
  WEAVE_CHECK(!tensors.empty(), "cat", "expected at least one tensor");
  const Tensor& first = tensors[0];
  check_defined(first, "cat");
  WEAVE_CHECK(first.dim() > 0, "cat", "cannot concatenate 0-d tensors; hint: use stack()");
  int d = normalize_dim(dim, first.dim(), "cat");
  Shape shape = first.shape();
  shape[d] = 0;
  DType dtype = first.dtype();
  std::vector<int64_t> sizes;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    check_defined(t, "cat");
    check_same_device(first, t, "cat");
    WEAVE_CHECK(t.dim() == first.dim(), "cat", "tensor {} has rank {}, expected {}", i, t.dim(),
                first.dim());
    for (int k = 0; k < t.dim(); ++k)
      WEAVE_CHECK(k == d || t.shape()[k] == first.shape()[k], "cat",
                  "tensor {} has shape {}, expected {} outside dimension {}", i, t.shape(),
                  first.shape(), d);
    shape[d] += t.shape()[d];
    sizes.push_back(t.shape()[d]);
    dtype = promote_types(dtype, t.dtype());
  }
  Tensor out = empty_on(shape, dtype, first.device());
  int64_t offset = 0;
  for (const Tensor& t : tensors) {
    Tensor part =
        make_view(out, t.shape(), out.strides(), out.offset() + offset * out.strides()[d]);
    kernels::copy(t, part);
    offset += t.shape()[d];
  }
  std::vector<InputInfo> infos;
  for (const Tensor& t : tensors) infos.emplace_back(t);
  // d cat = g split back into the pieces
  return autograd::record("CatBackward", tensors, out, [&] {
    return [sizes, d, infos](const BackwardArgs& args) -> Grads {
      Grads grads;
      int64_t start = 0;
      for (size_t i = 0; i < sizes.size(); ++i) {
        if (args.needs(i))
          grads.push_back(convert(args.grad().narrow(d, start, sizes[i]), infos[i].dtype));
        else
          grads.emplace_back();
        start += sizes[i];
      }
      return grads;
    };
  });
}

Tensor stack(const std::vector<Tensor>& tensors, int64_t dim) {
  WEAVE_CHECK(!tensors.empty(), "stack", "expected at least one tensor");
  check_defined(tensors[0], "stack");
  int d = normalize_dim(dim, tensors[0].dim() + 1, "stack");
  std::vector<Tensor> expanded;
  for (size_t i = 0; i < tensors.size(); ++i) {
    check_defined(tensors[i], "stack");
    WEAVE_CHECK(tensors[i].shape() == tensors[0].shape(), "stack",
                "tensor {} has shape {}, expected {}", i, tensors[i].shape(), tensors[0].shape());
    expanded.push_back(tensors[i].unsqueeze(d));
  }
  return cat(expanded, d);
}

std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim) {
  check_defined(x, "split");
  WEAVE_CHECK(x.dim() > 0, "split", "cannot split a 0-d tensor");
  int d = normalize_dim(dim, x.dim(), "split");
  int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  WEAVE_CHECK(total == x.shape()[d], "split", "sizes add up to {}, but dimension {} has size {}",
              total, d, x.shape()[d]);
  std::vector<Tensor> pieces;
  int64_t start = 0;
  for (int64_t size : sizes) {
    WEAVE_CHECK(size >= 0, "split", "sizes must be non-negative, found {}", size);
    Strides strides = x.strides();
    Shape shape = x.shape();
    shape[d] = size;
    pieces.push_back(make_view(x, shape, strides, x.offset() + start * x.strides()[d]));
    start += size;
  }
  // d split = the pieces' gradients concatenated (absent ones are zeros)
  return autograd::record("SplitBackward", {x}, pieces, [&] {
    return [d](const BackwardArgs& args) -> Grads { return {cat(args.grads, d)}; };
  });
}

std::vector<Tensor> split(const Tensor& x, int64_t size, int64_t dim) {
  check_defined(x, "split");
  WEAVE_CHECK(size > 0, "split", "split size must be positive, found {}", size);
  const int64_t total = x.size(dim);
  std::vector<int64_t> sizes;
  for (int64_t start = 0; start < total; start += size)
    sizes.push_back(std::min(size, total - start));
  if (sizes.empty()) sizes.push_back(0);
  return split(x, sizes, dim);
}

std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim) {
  check_defined(x, "chunk");
  WEAVE_CHECK(chunks > 0, "chunk", "chunks must be positive, found {}", chunks);
  const int64_t total = x.size(dim);
  return split(x, std::max<int64_t>((total + chunks - 1) / chunks, 1), dim);
}

Tensor detail::wrapped_index(const Tensor& index, int64_t n, int d, const char* op, bool wraps) {
  Tensor idx = convert(index, kInt64);
  if (idx.numel() == 0) return idx;
  // A step captured in a CUDA graph cannot read the indices on the host: it wraps them as they
  // come (the eager calls checked them).
  if (capturing_graph(idx))
    return where(lt(idx, wrap_scalar(0, idx)), idx + wrap_scalar(double(n), idx), idx);
  const int64_t lo = min(idx).item<int64_t>(), hi = max(idx).item<int64_t>();
  WEAVE_CHECK(lo >= (wraps ? -n : 0) && hi < n, op,
              "index out of range for dimension {} of size {}: found [{}, {}]{}", d, n, lo, hi,
              wraps ? "" : "; hint: ids lie in [0, size) (a negative id does not count back)");
  if (lo >= 0) return idx;
  return where(lt(idx, wrap_scalar(0, idx)), idx + wrap_scalar(double(n), idx), idx);
}

Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index) {
  return detail::index_select_rows(x, dim, index, "index_select", true);
}

Tensor detail::index_select_rows(const Tensor& x, int64_t dim, const Tensor& index, const char* op,
                                 bool wraps) {
  check_index_args(x, index, op);
  WEAVE_CHECK(index.dim() <= 1, op, "expected a 0-d or 1-d index, found shape {}", index.shape());
  int d = normalize_dim(dim, x.dim(), op);
  const int64_t n = x.dim() == 0 ? 1 : x.shape()[d];
  const Tensor idx = wrapped_index(index, n, d, op, wraps).contiguous();
  Tensor src = x.contiguous();
  int64_t outer = 1, inner = 1;
  for (int k = 0; k < d; ++k) outer *= x.shape()[k];
  for (int k = d + 1; k < x.dim(); ++k) inner *= x.shape()[k];
  Shape shape = x.shape();
  if (x.dim() > 0) shape[d] = idx.numel();
  Tensor out = empty_on(shape, x.dtype(), x.device());
  kernels::index_select(src, outer, n, inner, idx, out);
  // d index_select = g added into zeros at the selected rows
  return autograd::record("IndexSelectBackward", {x}, out, [&] {
    return [in = InputInfo(x), idx, outer, n, inner](const BackwardArgs& args) -> Grads {
      Tensor gx = zeros(in.shape, {.dtype = in.dtype, .device = args.grad().device()});
      kernels::index_add(gx, outer, n, inner, idx, convert(args.grad(), in.dtype).contiguous());
      return {gx};
    };
  });
}

}  // namespace weave
