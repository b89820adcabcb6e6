#pragma once
// Gradient buckets shared by the data-parallel wrappers: the order backward produces gradients
// in, agreed across ranks, and cut into buckets by size.
#include <memory>
#include <vector>

#include "weave/distributed/distributed.h"

namespace weave::parallel::detail {

/// Completes a traced ready order (parameter indices) with the parameters that never became
/// ready, latest registered first, then makes every rank of the group adopt the first rank's
/// order. Returns that order; `differs_anywhere` tells (on every rank) whether some rank's own
/// order was different. `counts`, if given, are per-rank 0/1 flags summed over the group in
/// the same round (how many ranks set each). Collective.
std::vector<int> agree_on_order(std::vector<int> trace, size_t parameters, const dist::Group& group,
                                bool& differs_anywhere, std::vector<int64_t>* counts = nullptr);

/// Registers, on every parameter, a post-accumulate-grad hook that calls
/// state->on_ready(i, state) while the state lives; returns the handles.
template <class State>
std::vector<HookHandle> hook_ready(const std::vector<Tensor>& params,
                                   const std::shared_ptr<State>& state) {
  std::vector<HookHandle> hooks;
  std::weak_ptr<State> weak = state;
  for (size_t i = 0; i < params.size(); ++i)
    hooks.push_back(params[i].register_post_accumulate_grad_hook([weak, i](Tensor&) {
      if (auto alive = weak.lock()) alive->on_ready(int(i), weak);
    }));
  return hooks;
}

/// Cuts `order` into buckets of consecutive parameters with one dtype and device, the first
/// bucket up to first_mb, the others up to mb (a parameter larger than the cap gets its own).
std::vector<std::vector<int>> cut_buckets(const std::vector<int>& order,
                                          const std::vector<Tensor>& params, double first_mb,
                                          double mb);

}  // namespace weave::parallel::detail
