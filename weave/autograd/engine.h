#pragma once
// The backward engine: deterministic, single-threaded per call. Ready nodes run highest
// sequence number first, which replays the forward pass in exact reverse order on every
// rank (the property that keeps collectives matched across ranks in backward).
#include <cstdint>
#include <functional>
#include <vector>

#include "weave/tensor/tensor.h"

namespace weave::autograd {

/// Backpropagates from roots. grads[i] is the gradient of roots[i]; an undefined or missing
/// entry means 1 for a one-element root (0 for an empty one, such as a collective's token).
/// Gradients accumulate into the leaves' grad(). Without retain_graph the graph's saved
/// tensors are freed as it runs.
///
/// With run_must_run_nodes (the default), the pass also runs every node marked with
/// must_run() on this thread that no earlier backward ran, with zero upstream gradient where
/// the roots do not reach it. Communicating nodes are marked so: every rank then runs every
/// collective's backward, in the same (reverse creation) order, so `loss.backward()` on every
/// rank cannot deadlock even where a rank's loss does not depend on a collective. Schedules
/// that interleave micro-batches pass their tokens as roots and turn it off. Roots may be
/// empty (a rank with no loss of its own).
void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads = {},
              bool retain_graph = false, bool run_must_run_nodes = true);

class Node;
/// Marks a node as one the next backward on this thread must run even if no root reaches it.
/// The engine holds it strongly until a backward runs it.
void must_run(std::shared_ptr<Node> node);
/// Number of marked nodes on this thread that no backward has run yet.
size_t must_run_pending();
/// Nodes ever marked on this thread: the differentiable collectives (and other communicating
/// nodes) recorded so far. A difference over a stretch of code counts what it issued.
uint64_t must_run_marked();
/// Forgets them all (a forward whose graph no rank will backpropagate).
void clear_must_run();

/// For a forward that will never be backpropagated (evaluation with grad mode on): the nodes
/// marked while the guard lives are forgotten when it ends; older ones stay pending. Every
/// rank must use the guard around the same forward. NoGradGuard is cheaper where it fits: it
/// records nothing at all.
class ForwardOnlyGuard {
 public:
  ForwardOnlyGuard();
  ~ForwardOnlyGuard();
  ForwardOnlyGuard(const ForwardOnlyGuard&) = delete;
  ForwardOnlyGuard& operator=(const ForwardOnlyGuard&) = delete;

 private:
  uint64_t first_;  // the first mark made under this guard
};

/// True while a backward pass runs on this thread (inside hooks and callbacks), except inside
/// a recomputation (detail::RecomputeGuard).
bool in_backward();

namespace detail {
/// Activation checkpointing runs a region's forward again inside backward: while the guard
/// lives, in_backward() is false on this thread, so the ops behave as they did in forward
/// (autocast included).
class RecomputeGuard {
 public:
  RecomputeGuard();
  ~RecomputeGuard();
  RecomputeGuard(const RecomputeGuard&) = delete;
  RecomputeGuard& operator=(const RecomputeGuard&) = delete;

 private:
  int depth_;
};
/// True while a RecomputeGuard lives on this thread (a module's forward hooks tell a
/// recomputation from the forward pass by it).
bool recomputing();
}  // namespace detail

/// Runs fn once when the backward pass now running on this thread finishes. It does not run
/// when backward unwinds by an exception. Raises outside backward.
void queue_callback(std::function<void()> fn);

/// Runs fn(failed) once when the backward pass now running on this thread ends, either way:
/// failed is false when it finished (fn runs in order with the queue_callback callbacks) and
/// true when an exception unwinds it (from a node, a hook, or an earlier callback). Wrappers
/// that keep per-backward state (data parallelism's outstanding all_reduces) reset it here, so
/// whatever unwinds out of backward, the next one starts clean. An exception that fn raises
/// when failed is true is dropped: the error that unwound backward is the one that propagates.
/// Raises outside backward.
void queue_final_callback(std::function<void(bool failed)> fn);

}  // namespace weave::autograd
