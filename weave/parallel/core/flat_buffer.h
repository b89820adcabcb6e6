#pragma once
// The layer every data-parallel strategy stands on (internal): parameters and gradients laid out
// in flat buffers whose slices they are (readiness.h says when a bucket of them is complete).
//
//   DDP                all_reduce of each gradient bucket, launched from the hooks
//   FSDP               reduce_scatter of each unit's gradients, launched from the hooks;
//                      the parameters live in gathered flat buffers, sharded between uses
//   ZeRO-1             reduce_scatter of the flat gradients, step of a slice of the flat
//                      parameters, all_gather back into them: no per-step copies
//   DistributedOptim.  all_reduce of gradient buckets at step()
//   decentralized      per-bucket optimizer step from the hooks, then a neighbour average of the
//                      bucket's flat parameters
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "weave/distributed/distributed.h"
#include "weave/optim/optimizer.h"

namespace weave::parallel::detail {

/// Tensors laid out back to back in one contiguous tensor of one dtype and device.
struct FlatBuffer {
  Tensor flat;
  std::vector<int64_t> offsets;  // element offset of each member
  std::vector<Shape> shapes;
  /// Elements the members occupy; flat holds `used` rounded up to a multiple of pad_to, plus
  /// `extra` trailing elements.
  int64_t used = 0;

  /// Zero-filled room for tensors shaped like `tensors` (one dtype and device: the first's).
  static FlatBuffer like(const std::vector<Tensor>& tensors, int64_t pad_to = 1, int64_t extra = 0);
  /// Room for `tensors`, which move into it (bind_data: their values, then their memory).
  static FlatBuffer adopt(const std::vector<Tensor>& tensors, int64_t pad_to = 1);
  /// The layout of like(), its memory not allocated (a released storage: allocate_again()), in
  /// `dtype` (default: the first tensor's).
  static FlatBuffer unallocated(const std::vector<Tensor>& tensors, int64_t pad_to = 1,
                                std::optional<DType> dtype = std::nullopt);
  /// Member k's slice of `flat`, in its shape.
  Tensor view(size_t k) const { return view_in(flat, k); }
  /// Member k's slice of another tensor laid out like `flat` (a gathered copy, a wire buffer).
  Tensor view_in(const Tensor& buffer, size_t k) const;
  size_t size() const { return shapes.size(); }
  /// Adds a shard of this buffer to the optimizer's `groups` (one per parameter group, their
  /// weight decays set): `shard` holds elements [first, first + shard.numel()), and member k
  /// belongs to group group_of[k]. Each member's elements in the shard join its group as a
  /// range of the shard; a shard of padding alone joins group 0 with no elements (stepped like
  /// every shard, never decayed). FSDP's and ZeRO-1's parameter groups.
  void add_shard_to_groups(std::vector<optim::ParamGroup>& groups, const Tensor& shard,
                           int64_t first, const std::vector<int>& group_of) const;
};

/// A flat gradient buffer averaged over a group in one asynchronous all_reduce, optionally in a
/// narrower dtype on the wire (DDP's buckets, DistributedOptimizer's).
struct GradBucket {
  FlatBuffer grads;
  Tensor wire;  // what travels: grads.flat itself, or its copy in the compressed dtype
  dist::Work work;
  /// What the average is multiplied by once it arrived (an expert's 1 / expert group size).
  double scale = 1.0;

  /// Room for the gradients of `params` (one dtype and device; none: `extra` float32 elements
  /// on the host alone), plus `extra` trailing elements.
  static GradBucket allocate(const std::vector<Tensor>& params, std::optional<DType> compress,
                             int64_t extra = 0);
  void launch_average(const dist::Group& group);
  /// Waits for the average, widens it back into grads.flat and applies `scale`.
  void wait();
};

/// Makes `view` the memory of `tensor`: the handle keeps its identity (a leaf, its hooks, the
/// optimizer's reference to it) while its elements move into the view's storage. The tensor's
/// values are copied over first.
void bind_data(const Tensor& tensor, Tensor view);

/// Makes `view` the memory of `tensor` without copying its values (which are dropped); the
/// tensor takes the view's dtype (FSDP's gathered parameters in a mixed-precision policy's).
void bind_storage(const Tensor& tensor, const Tensor& view);

/// Makes `view` the gradient of `param`, copying what it accumulated so far (or zeros) into it,
/// unless the gradient already is that view.
void bind_grad(const Tensor& param, Tensor view);

}  // namespace weave::parallel::detail
