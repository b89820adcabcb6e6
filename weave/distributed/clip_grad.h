#pragma once
// Gradient clipping when the parameters are spread over the ranks of a group (tensor or
// pipeline parallelism): the norm is that of the whole model, so every rank scales by the same
// factor and replicas stay identical. This is the primitive for a layout declared by hand (the
// caller says which tensors are sharded and which replicated); a model whose layers, wrappers and
// pipelines recorded where each parameter lives clips with parallel::clip_grad_norm_(params,
// max_norm), which reads those placements (ZeRO-1 and FSDP clip through it).
#include <cmath>
#include <vector>

#include "weave/distributed/distributed.h"

namespace weave::dist {

/// Scales the gradients of `sharded` and `replicated` so that the joint norm of the model's
/// gradients, over every rank of `group`, is at most max_norm; returns that norm before
/// clipping (the same value on every rank). `sharded` are this rank's own parameters (shards,
/// pipeline stages: every rank's count); `replicated` are held identically by every rank of
/// the group (layer norms in a tensor-parallel block: counted once). norm_type is any p >= 1 or
/// INFINITY. With error_if_nonfinite, a NaN or infinite total norm raises on every rank alike
/// (the norm is the same everywhere). Collective over `group`: every member calls it.
double clip_grad_norm_(const std::vector<Tensor>& sharded, const std::vector<Tensor>& replicated,
                       double max_norm, const Group& group = world(), double norm_type = 2.0,
                       bool error_if_nonfinite = false);

}  // namespace weave::dist
