// Model-parallel gradient clipping: partial norms reduced over the group.
#include "weave/distributed/clip_grad.h"

#include "weave/ops/ops.h"
#include "weave/optim/optimizer.h"

namespace weave::dist {

double clip_grad_norm_(const std::vector<Tensor>& sharded, const std::vector<Tensor>& replicated,
                       double max_norm, const Group& group, double norm_type,
                       bool error_if_nonfinite) {
  const char* op = "clip_grad_norm_";
  const bool inf = std::isinf(norm_type);
  // Every rank's shards add up (or max) over the group; replicated ones count once, so each
  // rank adds its own copy after the reduction. A rank whose arguments are bad says so in the
  // same all_reduce, so every rank raises instead of the others scaling alone.
  std::exception_ptr my_error;
  double partial = 0, mine = 0;
  try {
    optim::detail::check_max_norm(max_norm, op);
    partial = optim::detail::grad_norm_partial(sharded, norm_type, op);
    mine = optim::detail::grad_norm_partial(replicated, norm_type, op);
  } catch (const Error&) {
    my_error = std::current_exception();
  }
  Tensor reduced = from_vector<double>({partial, my_error ? 1.0 : 0.0});
  all_reduce(reduced, inf ? ReduceOp::Max : ReduceOp::Sum, group);
  if (my_error) std::rethrow_exception(my_error);
  const std::vector<double> values = reduced.to_vector<double>();
  WEAVE_CHECK(values[1] == 0, op, "another rank of group {} rejected its arguments; see its error",
              group.str());
  double total = inf ? (std::isnan(mine) ? mine : std::max(values[0], mine)) : values[0] + mine;
  if (!inf) total = std::pow(total, 1.0 / norm_type);
  optim::detail::check_finite_norm(total, error_if_nonfinite, op);
  optim::detail::scale_grads_to(sharded, max_norm, total);
  optim::detail::scale_grads_to(replicated, max_norm, total);
  return total;
}

}  // namespace weave::dist
