// Flat buffers, bound parameters and gradients, and shards cut into parameter groups.
#include "weave/parallel/core/flat_buffer.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include "weave/autograd/engine.h"
#include "weave/autograd/grad_mode.h"
#include "weave/ops/ops.h"
#include "weave/tensor/tensor_impl.h"

namespace weave::parallel::detail {

namespace {
// The members' shapes and offsets, and the elements a buffer of them padded to pad_to holds.
int64_t lay_out(FlatBuffer& buffer, const std::vector<Tensor>& tensors, int64_t pad_to) {
  for (const Tensor& t : tensors) {
    buffer.shapes.push_back(t.shape());
    buffer.offsets.push_back(buffer.used);
    buffer.used += t.numel();
  }
  return (buffer.used + pad_to - 1) / pad_to * pad_to;
}
}  // namespace

FlatBuffer FlatBuffer::like(const std::vector<Tensor>& tensors, int64_t pad_to, int64_t extra) {
  FlatBuffer buffer;
  const int64_t padded = lay_out(buffer, tensors, pad_to);
  buffer.flat = zeros(
      {padded + extra},
      tensors.empty() ? TensorOptions{.dtype = kFloat32}
                      : TensorOptions{.dtype = tensors[0].dtype(), .device = tensors[0].device()});
  return buffer;
}

FlatBuffer FlatBuffer::unallocated(const std::vector<Tensor>& tensors, int64_t pad_to,
                                   std::optional<DType> dtype_option) {
  FlatBuffer buffer;
  const int64_t padded = lay_out(buffer, tensors, pad_to);
  const DType dtype = dtype_option      ? *dtype_option
                      : tensors.empty() ? kFloat32
                                        : tensors[0].dtype();
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = Storage::unallocated(size_t(padded) * itemsize(dtype),
                                       tensors.empty() ? kCPU : tensors[0].device());
  impl->shape = {padded};
  impl->strides = {1};
  impl->dtype = dtype;
  buffer.flat = Tensor(std::move(impl));
  return buffer;
}

FlatBuffer FlatBuffer::adopt(const std::vector<Tensor>& tensors, int64_t pad_to) {
  FlatBuffer buffer = like(tensors, pad_to);
  for (size_t k = 0; k < tensors.size(); ++k) bind_data(tensors[k], buffer.view(k));
  return buffer;
}

Tensor FlatBuffer::view_in(const Tensor& buffer, size_t k) const {
  return make_view(buffer, shapes[k], contiguous_strides(shapes[k]), buffer.offset() + offsets[k]);
}

GradBucket GradBucket::allocate(const std::vector<Tensor>& params, std::optional<DType> compress,
                                int64_t extra) {
  GradBucket bucket;
  bucket.grads = FlatBuffer::like(params, 1, extra);
  const Tensor& flat = bucket.grads.flat;
  bucket.wire = compress && *compress != flat.dtype()
                    ? empty(flat.shape(), {.dtype = *compress, .device = flat.device()})
                    : flat;
  return bucket;
}

void GradBucket::launch_average(const dist::Group& group) {
  if (!wire.is_same(grads.flat)) wire.copy_(grads.flat);
  work = dist::all_reduce(wire, dist::ReduceOp::Avg, group, /*async_op=*/true);
}

void GradBucket::wait() {
  work.wait();
  if (!wire.is_same(grads.flat)) grads.flat.copy_(wire);
  if (scale != 1.0) grads.flat.mul_(scale);
}

void bind_data(const Tensor& tensor, Tensor view) {
  WEAVE_CHECK(tensor.shape() == view.shape() && tensor.dtype() == view.dtype(), "bind_data",
              "expected a view of shape {} and dtype {}, found {} and {}", tensor.shape(),
              tensor.dtype(), view.shape(), view.dtype());
  {
    NoGradGuard no_grad;
    view.copy_(tensor.detach());
  }
  bind_storage(tensor, view);
}

void bind_storage(const Tensor& tensor, const Tensor& view) {
  TensorImpl& impl = *tensor.impl();
  impl.dtype = view.dtype();
  impl.storage = view.storage();
  impl.strides = view.strides();
  impl.offset = view.offset();
}

void bind_grad(const Tensor& param, Tensor view) {
  Tensor grad = param.grad();
  if (grad.defined() && grad.storage() == view.storage() && grad.offset() == view.offset()) return;
  NoGradGuard no_grad;
  if (grad.defined())
    view.copy_(grad);
  else
    view.zero_();
  param.set_grad(view);
}

}  // namespace weave::parallel::detail

namespace weave::parallel::detail {

void FlatBuffer::add_shard_to_groups(std::vector<optim::ParamGroup>& groups, const Tensor& shard,
                                     int64_t first, const std::vector<int>& group_of) const {
  bool listed = false;
  for (size_t k = 0; k < size(); ++k) {
    const int64_t begin = offsets[k], end = begin + shapes[k].numel();
    const int64_t lo = std::max(begin, first), hi = std::min(end, first + shard.numel());
    if (lo >= hi) continue;
    optim::ParamGroup& group = groups[size_t(group_of[k])];
    group.params.push_back(shard);
    group.ranges.push_back({lo - first, hi - first});
    listed = true;
  }
  if (!listed && !groups.empty()) {
    groups[0].params.push_back(shard);
    groups[0].ranges.push_back({0, 0});
  }
}

}  // namespace weave::parallel::detail
