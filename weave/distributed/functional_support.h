#pragma once
// The building blocks of the differentiable collectives (internal; functional.cpp and
// region_mappings.cpp): argument checks, collectives that record nothing, and recording a
// communicating node so that every rank runs its backward.
#include <utility>
#include <vector>

#include "weave/autograd/engine.h"
#include "weave/autograd/grad_mode.h"
#include "weave/autograd/node.h"
#include "weave/distributed/distributed.h"

namespace weave::dist::functional::detail {

using autograd::BackwardArgs;
using Grads = std::vector<Tensor>;

/// Raises naming op for an undefined input.
void check_input(const Tensor& x, const char* op);
/// axis normalized against x's rank (x must have at least one dim).
int axis_of(const Tensor& x, int64_t axis, const char* op);
/// Raises unless x's axis divides among the group's ranks.
void check_divisible(const Tensor& x, int axis, const Group& g, const char* op);
/// all_reduce into a new tensor, recording nothing.
Tensor raw_all_reduce(const Tensor& x, ReduceOp op, const Group& g);
/// all_gather along axis into a new tensor, recording nothing.
Tensor raw_all_gather(const Tensor& x, int axis, const Group& g);
/// s with dimension `axis` set to `size`.
Shape with_dim(Shape s, int axis, int64_t size);
/// The dtype and device of x, for a new tensor.
TensorOptions like(const Tensor& x);
/// True where x takes part in autograd.
bool wants_grad(const Tensor& x);
/// True for a group of one (the op is the identity there), after checking this rank belongs to
/// the group: a non-member gets the membership error whatever the group's size.
bool alone_in(const Group& g, const char* op);

/// Records `output` as produced by a communicating node with one input (x may be undefined),
/// when grad mode is on and `needed` holds. The node is registered with the engine so every
/// rank runs its backward.
template <class BackwardOrMaker>
Tensor record(const char* name, const Tensor& x, Tensor output, bool needed,
              BackwardOrMaker&& backward) {
  return autograd::record_communicating(name, {x}, {std::move(output)}, needed,
                                        std::forward<BackwardOrMaker>(backward))
      .front();
}

/// Runs `forward` without recording.
template <class F>
Tensor quietly(F&& forward) {
  NoGradGuard no_grad;
  return forward();
}

}  // namespace weave::dist::functional::detail
