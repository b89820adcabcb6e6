#pragma once
// Activation checkpointing: trade compute for memory. A checkpointed region runs forward as
// usual and records its graph, but keeps none of the tensors its ops save for backward; when
// backward first needs one, the region's forward runs again from its inputs and the saved
// tensors are taken from that recomputation. Peak activation memory falls to the region
// boundaries plus one region's activations, for about one more forward of compute.
//
//   // each transformer block keeps only its input for backward
//   for (auto& block : blocks)
//     x = autograd::checkpoint([&block](const Tensor& h) { return (*block)(h); }, x);
//   loss = cross_entropy(head(x), target);
//   loss.backward();                       // recomputes each block as backward reaches it
//
// Non-reentrant (PyTorch's use_reentrant=False): one backward pass runs over one graph, so the
// engine's order is unchanged and everything built on it composes:
//  - gradients are bitwise those of the plain run: the recomputation restores the default
//    generator (and options.generators), so dropout draws the same masks, and the autocast
//    state of the forward;
//  - data parallelism sees each parameter's gradient accumulated once, its hooks fire once;
//  - collectives inside the region (tensor- and sequence-parallel layers) are issued again by
//    the recomputation, at the same point of backward on every rank, and leave no pending
//    backward of their own.
// `fn` runs again inside backward: whatever it captures must outlive that backward, and it must
// do the same work given the same inputs (the recomputation checks the number of
// differentiable collectives it issued, the saved tensors' count, shapes and dtypes, and that
// no input was modified in place). Without grad mode, checkpoint just calls fn.
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "weave/tensor/random.h"
#include "weave/tensor/tensor.h"

namespace weave::autograd {

struct CheckpointOptions {
  /// Selective checkpointing: the results of these kernels are kept from forward, and the
  /// recomputation reuses them instead of computing them again. "matmul" keeps every matrix
  /// product (matmul and linear, the step's FLOPs), so backward recomputes only the cheap
  /// elementwise and normalization work around them, at the memory of one product result
  /// each. Empty (the default): keep nothing, recompute everything.
  std::vector<std::string> keep = {};
  /// Generators besides the default one that the region draws from (dropout given its own
  /// generator): the recomputation replays them from their state at the region's start.
  std::vector<Generator*> generators = {};
};

using CheckpointFunction = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;

/// Runs fn(inputs) as a checkpointed region and returns its outputs. Raises weave::Error when
/// no output requires grad, or when inputs require grad and no output depends on them.
std::vector<Tensor> checkpoint(const CheckpointFunction& fn, const std::vector<Tensor>& inputs,
                               const CheckpointOptions& options = {});
/// One input, one output.
Tensor checkpoint(const std::function<Tensor(const Tensor&)>& fn, const Tensor& input,
                  const CheckpointOptions& options = {});

namespace detail {
class CheckpointRegion;
/// The innermost region on this thread that keeps kernel results (in forward) or hands them
/// back (recomputing), or null.
CheckpointRegion* keeping_region();
Tensor keep_result(CheckpointRegion& region, const char* kernel,
                   const std::function<Tensor()>& compute);
/// A kernel's result as selective checkpointing wants it: compute() outside a region that keeps
/// `kernel`, the kept result when such a region is recomputed.
template <class Compute>
Tensor kept_result(const char* kernel, Compute&& compute) {
  if (CheckpointRegion* region = keeping_region())
    return keep_result(*region, kernel, std::forward<Compute>(compute));
  return compute();
}
/// Kernel results that recomputations on this thread reused instead of computing (for tests).
int64_t reused_results();
}  // namespace detail

}  // namespace weave::autograd
