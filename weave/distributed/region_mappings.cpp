// The region mappings of tensor parallelism with a replicated loss (functional.h): each is a
// forward and its adjoint under that convention, from functional_support.h's building blocks.
#include "weave/distributed/functional.h"
#include "weave/distributed/functional_support.h"
#include "weave/ops/ops.h"
#include "weave/tensor/tensor_impl.h"

namespace weave::dist::functional {

using namespace detail;

// ---- region mappings (replicated loss) -------------------------------------------------------

Tensor copy_to_group(const Tensor& x, const Group& g) {
  check_input(x, "copy_to_group");
  if (alone_in(g, "copy_to_group")) return x;
  Tensor y = make_view(x, x.shape(), x.strides(), x.offset());
  // identity forward; the replicas' gradients are partial, so they are summed
  return record("CopyToGroupBackward", x, y, wants_grad(x), [&] {
    return [g](const BackwardArgs& args) -> Grads {
      return {raw_all_reduce(args.grad(), ReduceOp::Sum, g)};
    };
  });
}

Tensor reduce_from_group(const Tensor& x, const Group& g) {
  check_input(x, "reduce_from_group");
  if (alone_in(g, "reduce_from_group")) return x;
  Tensor y = quietly([&] { return raw_all_reduce(x, ReduceOp::Sum, g); });
  // the loss is replicated, so each partial result receives the gradient as is
  return record("ReduceFromGroupBackward", x, y, wants_grad(x),
                [&] { return [](const BackwardArgs& args) -> Grads { return {args.grad()}; }; });
}

Tensor scatter_to_group(const Tensor& x, int64_t axis, const Group& g) {
  check_input(x, "scatter_to_group");
  const int a = axis_of(x, axis, "scatter_to_group");
  check_divisible(x, a, g, "scatter_to_group");
  if (alone_in(g, "scatter_to_group")) return x;
  const int64_t piece = x.size(a) / g.size();
  Tensor y = quietly([&] { return x.narrow(a, g.rank() * piece, piece).contiguous().clone(); });
  // the pieces' gradients are gathered back into the full tensor on every rank
  return record("ScatterToGroupBackward", x, y, wants_grad(x), [&] {
    return
        [a, g](const BackwardArgs& args) -> Grads { return {raw_all_gather(args.grad(), a, g)}; };
  });
}

Tensor gather_from_group(const Tensor& x, int64_t axis, const Group& g) {
  check_input(x, "gather_from_group");
  const int a = axis_of(x, axis, "gather_from_group");
  if (alone_in(g, "gather_from_group")) return x;
  Tensor y = quietly([&] { return raw_all_gather(x, a, g); });
  // the loss is replicated: each rank takes its own piece of the gradient
  return record("GatherFromGroupBackward", x, y, wants_grad(x), [&] {
    return [a, g, piece = x.size(a)](const BackwardArgs& args) -> Grads {
      return {args.grad().narrow(a, g.rank() * piece, piece).contiguous()};
    };
  });
}

// The sequence-parallel pair is all_gather / reduce_scatter_sum itself: each is the other's
// adjoint under either convention, so the names only mark where a sequence region starts and ends.
Tensor gather_from_sequence_group(const Tensor& x, int64_t axis, const Group& g) {
  return all_gather(x, axis, g);
}

Tensor reduce_scatter_to_sequence_group(const Tensor& x, int64_t axis, const Group& g) {
  return reduce_scatter_sum(x, axis, g);
}

}  // namespace weave::dist::functional
