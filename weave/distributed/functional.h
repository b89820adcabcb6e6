#pragma once
// Differentiable collectives: each records an autograd node whose backward is the exact
// adjoint of its forward, so gradients flow across ranks. The objective is the sum of the
// ranks' losses, L = sum_r L_r: every rank calls backward on its own loss (or on nothing).
//
//   namespace F = weave::dist::functional;
//   Tensor total = F::all_reduce_sum(local);     // backward: all_reduce_sum of the gradients
//   Tensor mine = F::scatter(batch, 0);          // root 0 splits along axis 0
//
// | forward                      | backward                                               |
// | all_reduce_sum / _avg        | all_reduce_sum / _avg of the gradients                 |
// | all_reduce_max / _min        | all_reduce_sum of the gradients where input == result, |
// |                              | ties (on any ranks) sharing equally                    |
// | broadcast(root)              | reduce_sum to root; other ranks' inputs get zero       |
// | reduce_sum(root)             | broadcast from root                                    |
// | all_gather(axis)             | reduce_scatter_sum(axis)                               |
// | reduce_scatter_sum(axis)     | all_gather(axis)                                       |
// | gather(root, axis)           | scatter(root, axis)                                    |
// | scatter(root, axis)          | gather(root, axis); other ranks' inputs get zero       |
// | all_to_all(split, concat)    | all_to_all(concat, split)                              |
// | all_to_all(input_splits)     | all_to_all with the input and output splits swapped    |
// | send_recv(to, from)          | send_recv(from, to) of the gradient                    |
// | remote_send(dst)             | recv of the gradient from dst                          |
// | remote_recv(src)             | send of the gradient to src                            |
//
// Roots and peers are group ranks; axes may be negative. A group of size one is the identity.
// A node is recorded when grad mode is on and the local input requires grad (broadcast,
// scatter and remote_recv learn it from the sending rank); ranks running the same program agree.
// Non-root results of reduce_sum and gather, and remote_send's result, are empty "token"
// tensors that stay in the graph. By default every backward also runs the collective nodes
// that no earlier backward ran (see autograd::backward), so plain loss.backward() on every rank
// never deadlocks; docs/collectives.md explains why.
#include "weave/distributed/distributed.h"

namespace weave::dist::functional {

Tensor all_reduce_sum(const Tensor& x, const Group& group = world());
Tensor all_reduce_avg(const Tensor& x, const Group& group = world());
Tensor all_reduce_max(const Tensor& x, const Group& group = world());
Tensor all_reduce_min(const Tensor& x, const Group& group = world());
/// Root's x on every rank; x may be undefined off root (shape, dtype and device type come
/// from root: a rank without x receives on the CPU for a CPU root, on its GPU for a CUDA one).
Tensor broadcast(const Tensor& x, int root = 0, const Group& group = world());
/// The sum on root; a token elsewhere.
Tensor reduce_sum(const Tensor& x, int root = 0, const Group& group = world());
/// Inputs concatenated along axis in group-rank order.
Tensor all_gather(const Tensor& x, int64_t axis = 0, const Group& group = world());
/// Sum over ranks, split along axis; rank r keeps piece r (axis must divide by the group size).
Tensor reduce_scatter_sum(const Tensor& x, int64_t axis = 0, const Group& group = world());
/// Inputs concatenated along axis on root; a token elsewhere.
Tensor gather(const Tensor& x, int root = 0, int64_t axis = 0, const Group& group = world());
/// Root's x split along axis; rank r gets piece r. x may be undefined off root (as in
/// broadcast, its pieces land on root's device type).
Tensor scatter(const Tensor& x, int root = 0, int64_t axis = 0, const Group& group = world());
/// Splits x along split_axis, sends piece j to rank j, concatenates what arrives along
/// concat_axis in rank order.
Tensor all_to_all(const Tensor& x, int64_t split_axis = 0, int64_t concat_axis = 0,
                  const Group& group = world());
/// Uneven splits along axis 0: input_splits[j] rows of x go to group rank j (one entry per rank,
/// zeros allowed, adding up to x's rows); returns the rows every rank sent this one,
/// concatenated in rank order, and their counts in *output_splits when given. One small
/// all_gather of every rank's splits comes first: splits that do not add up, or dtypes or row
/// shapes that differ, raise on every rank before any data moves.
Tensor all_to_all(const Tensor& x, const std::vector<int64_t>& input_splits,
                  const Group& group = world(), std::vector<int64_t>* output_splits = nullptr);
/// The same with both splits known (an exchange's reverse, or splits the ranks exchanged
/// themselves): no plan is gathered. Each rank's own splits are checked (rows, non-negative) and
/// a failure raises on every rank; whether the ranks' splits pair up is checked in full check
/// mode only (WEAVE_CHECK_COLLECTIVES=full).
Tensor all_to_all(const Tensor& x, const std::vector<int64_t>& input_splits,
                  const std::vector<int64_t>& output_splits, const Group& group = world());
/// A shift (JAX's ppermute): sends x to group rank `to` and returns what rank `from` sent, in
/// one exchange. Every rank of the group calls it with a tensor of one shape and dtype, and the
/// `to`s form a permutation whose inverse is the `from`s (a ring: to = r + 1, from = r - 1, mod
/// n); otherwise every rank raises, naming the first rank that does not pair up.
Tensor send_recv(const Tensor& x, int to, int from, const Group& group = world());
/// Sends x to group rank dst without waiting for dst to receive (dist::isend: x must not be
/// written until dist::wait_sends(group)); returns a token (keep it or let backward find it).
/// Its backward receives the gradient from dst.
Tensor remote_send(const Tensor& x, int dst, const Group& group = world());
/// Receives the tensor remote_send sent from group rank src (shape, dtype and device type
/// travel with it). Its backward sends the gradient back to src, again without waiting.
Tensor remote_recv(int src, const Group& group = world());

/// Seconds this thread has spent waiting to receive in remote_recv and in remote_send's
/// backward (a pipeline stage's idle time).
double receive_wait_seconds();

// ---- tensor-parallel region mappings (replicated loss: the same loss on every rank, counted
// once; the opposite convention to the ops above). -----------------------------------------

/// Enter a parallel region: identity forward, all_reduce_sum of the gradient backward.
Tensor copy_to_group(const Tensor& x, const Group& group = world());
/// Leave it by summing partial results: all_reduce_sum forward, identity backward.
Tensor reduce_from_group(const Tensor& x, const Group& group = world());
/// Keep this rank's piece along axis forward; all_gather of the gradient backward.
Tensor scatter_to_group(const Tensor& x, int64_t axis = -1, const Group& group = world());
/// all_gather along axis forward; keep this rank's piece of the gradient backward.
Tensor gather_from_group(const Tensor& x, int64_t axis = -1, const Group& group = world());
/// Sequence parallelism: all_gather forward, reduce_scatter_sum backward (the same op as
/// all_gather; the name marks the region).
Tensor gather_from_sequence_group(const Tensor& x, int64_t axis = 0, const Group& group = world());
/// Sequence parallelism: reduce_scatter_sum forward, all_gather backward (the same op as
/// reduce_scatter_sum).
Tensor reduce_scatter_to_sequence_group(const Tensor& x, int64_t axis = 0,
                                        const Group& group = world());

}  // namespace weave::dist::functional
