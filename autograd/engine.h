#pragma once
// The backward engine: deterministic, single-threaded per call. Ready nodes run highest
// sequence number first, which replays the forward pass in exact reverse order on every
// rank (the property that keeps collectives matched across ranks in backward).
#include <functional>
#include <vector>

#include "tensor/tensor.h"

namespace weave::autograd {

/// Backpropagates from roots. grads[i] is the gradient of roots[i]; an undefined or missing
/// entry means 1 for a one-element root. Gradients accumulate into the leaves' grad().
/// Without retain_graph the graph's saved tensors are freed as it runs.
void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads = {},
              bool retain_graph = false);

/// Runs fn once when the backward pass now running on this thread finishes (data-parallel
/// wrappers wait for their outstanding communication here). Raises outside backward.
void queue_callback(std::function<void()> fn);

}  // namespace weave::autograd
