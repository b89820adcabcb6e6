#pragma once
// The traffic between a pipeline stage and its neighbours (internal): activations to the next
// stage, their gradients back to the previous one. Where a schedule step both sends to a peer
// and receives from it, the two go as one grouped exchange (dist::send_recv; Megatron-LM's
// send_forward_recv_backward): a send alone may wait until its receive is posted (NCCL), and two
// stages that each send first would wait for each other. An activation sent alone carries its
// dtype and shape (functional::remote_send), so a stage learns what its neighbour sends; the
// exchanges that follow carry tensors of the shapes learned (micro-batches are equal).
#include <utility>

#include "weave/distributed/distributed.h"

namespace weave::parallel::detail {

class StageLink {
 public:
  /// Stage `stage` of the pipeline over `group` (one stage per rank, in group order).
  StageLink(dist::Group group, int stage, int stages);

  /// The next activation from the previous stage, as a leaf that collects its gradient.
  Tensor recv_forward();
  void send_forward(const Tensor& y);
  /// The gradient of the activation sent to the next stage, shaped like `sent`.
  Tensor recv_backward(const Tensor& sent);
  void send_backward(const Tensor& grad);
  /// Sends y to the next stage and receives the gradient of `awaited` (an activation sent
  /// before) from it, together.
  Tensor send_forward_recv_backward(const Tensor& y, const Tensor& awaited);
  /// Sends a gradient to the previous stage and receives its next activation, together.
  Tensor send_backward_recv_forward(const Tensor& grad);
  /// One step of a schedule that may go both ways at once (the interleaved one): sends
  /// `to_next` and `to_previous` where defined, and receives an activation from the previous
  /// stage and a gradient from the next where asked, all as one grouped exchange. Returns the
  /// activation (a leaf collecting its gradient) and the gradient, undefined where not asked.
  std::pair<Tensor, Tensor> step(const Tensor& to_next, const Tensor& to_previous,
                                 bool from_previous, bool from_next);
  /// The group ranks of the neighbours: the next stage (activations go there) and the previous.
  int next() const { return next_; }
  int previous() const { return previous_; }
  /// Seconds spent waiting in receives and exchanges since construction.
  double waiting_s() const { return waiting_s_; }

 private:
  Tensor received_leaf(const Tensor& t) const;

  dist::Group group_;
  int next_, previous_;
  Tensor activation_like_;  // the shape and dtype the previous stage sends (learned)
  double waiting_s_ = 0;
};

}  // namespace weave::parallel::detail
