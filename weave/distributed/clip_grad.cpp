// Model-parallel gradient clipping: partial norms reduced over the group.
#include "weave/distributed/clip_grad.h"

#include "weave/ops/ops.h"
#include "weave/optim/optimizer.h"

namespace weave::dist {

double clip_grad_norm_(const std::vector<Tensor>& sharded, const std::vector<Tensor>& replicated,
                       double max_norm, const Group& group, double norm_type) {
  const char* op = "clip_grad_norm_";
  const bool inf = std::isinf(norm_type);
  // Every rank's shards add up (or max) over the group; replicated ones count once, so each
  // rank adds its own copy after the reduction.
  Tensor partial =
      full({1}, optim::detail::grad_norm_partial(sharded, norm_type, op), {.dtype = kFloat64});
  all_reduce(partial, inf ? ReduceOp::Max : ReduceOp::Sum, group);
  const double mine = optim::detail::grad_norm_partial(replicated, norm_type, op);
  double total = inf ? std::max(partial.item<double>(), mine) : partial.item<double>() + mine;
  if (!inf) total = std::pow(total, 1.0 / norm_type);
  optim::detail::scale_grads_to(sharded, max_norm, total);
  optim::detail::scale_grads_to(replicated, max_norm, total);
  return total;
}

}  // namespace weave::dist
