#pragma once
// The backward engine: deterministic, single-threaded per call. Ready nodes run highest
// sequence number first, which replays the forward pass in exact reverse order on every
// rank (the property that keeps collectives matched across ranks in backward).
#include <functional>
#include <vector>

#include "weave/tensor/tensor.h"

namespace weave::autograd {

/// Backpropagates from roots. grads[i] is the gradient of roots[i]; an undefined or missing
/// entry means 1 for a one-element root (0 for an empty one, such as a collective's token).
/// Gradients accumulate into the leaves' grad(). Without retain_graph the graph's saved
/// tensors are freed as it runs.
///
/// With run_pending_collectives (the default), the pass also runs every collective node this
/// thread recorded that no earlier backward ran, with zero upstream gradient where the roots do
/// not reach it: every rank then runs every collective's backward, in the same (reverse
/// creation) order, so `loss.backward()` on every rank cannot deadlock even where a rank's loss
/// does not depend on a collective. Schedules that interleave micro-batches pass their tokens
/// as roots and turn it off. Roots may be empty (a rank with no loss of its own).
void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads = {},
              bool retain_graph = false, bool run_pending_collectives = true);

class Node;
/// Marks a node as communicating (see backward). The engine keeps it until a backward runs it.
void register_collective(std::shared_ptr<Node> node);
/// Number of recorded collective nodes on this thread that no backward has run yet.
size_t pending_collectives();
/// Forgets them (for a forward whose graph will never be backpropagated on any rank).
void clear_pending_collectives();

/// Runs fn once when the backward pass now running on this thread finishes (data-parallel
/// wrappers wait for their outstanding communication here). Raises outside backward.
void queue_callback(std::function<void()> fn);

}  // namespace weave::autograd
