// A pipeline stage's point-to-point with its neighbours: standalone messages with their shapes,
// and grouped exchanges where a step goes both ways.
#include "weave/parallel/model_parallel/pipeline_link.h"

#include <chrono>

#include "weave/autograd/grad_mode.h"
#include "weave/distributed/functional.h"
#include "weave/distributed/tags.h"
#include "weave/ops/ops.h"

namespace weave::parallel::detail {

namespace {

namespace F = dist::functional;

// Tags of the gradients sent alone and of the exchanges (activations sent alone travel as
// functional::remote_send's messages, with their description).
constexpr int kGradientTag = dist::tags::kPipelineGradient;
constexpr int kExchangeTag = dist::tags::kPipelineExchange;
constexpr int kStepTag = dist::tags::kPipelineStep;

Tensor blank_like(const Tensor& t) {
  return empty(t.shape(), {.dtype = t.dtype(), .device = t.device()});
}

class Timer {
 public:
  explicit Timer(double& total) : total_(total), start_(std::chrono::steady_clock::now()) {}
  ~Timer() {
    total_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  double& total_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace

StageLink::StageLink(dist::Group group, int stage, int stages)
    : group_(std::move(group)),
      next_((stage + 1) % stages),
      previous_((stage + stages - 1) % stages) {}

Tensor StageLink::received_leaf(const Tensor& t) const {
  Tensor leaf = t.detach();
  if (autograd::GradMode::is_enabled()) leaf.requires_grad_(true);  // its gradient goes back
  return leaf;
}

Tensor StageLink::recv_forward() {
  const Timer timer(waiting_s_);
  Tensor activation;
  {
    NoGradGuard plain;  // the schedule sends the gradient back itself
    activation = F::remote_recv(previous_, group_);
  }
  activation_like_ = blank_like(activation);
  return received_leaf(activation);
}

void StageLink::send_forward(const Tensor& y) {
  NoGradGuard plain;
  F::remote_send(y.detach(), next_, group_);
}

Tensor StageLink::recv_backward(const Tensor& sent) {
  const Timer timer(waiting_s_);
  Tensor grad = blank_like(sent);
  dist::recv(grad, next_, group_, kGradientTag);
  return grad;
}

void StageLink::send_backward(const Tensor& grad) {
  dist::send(grad.contiguous(), previous_, group_, kGradientTag);
}

Tensor StageLink::send_forward_recv_backward(const Tensor& y, const Tensor& awaited) {
  const Timer timer(waiting_s_);
  Tensor grad = blank_like(awaited);
  dist::send_recv(y.detach().contiguous(), next_, grad, next_, group_, kExchangeTag);
  return grad;
}

Tensor StageLink::send_backward_recv_forward(const Tensor& grad) {
  const Timer timer(waiting_s_);
  WEAVE_CHECK(activation_like_.defined(), "Pipeline",
              "internal: an exchange before the first activation arrived");
  Tensor activation = blank_like(activation_like_);
  dist::send_recv(grad.contiguous(), previous_, activation, previous_, group_, kExchangeTag);
  return received_leaf(activation);
}

std::pair<Tensor, Tensor> StageLink::step(const Tensor& to_next, const Tensor& to_previous,
                                          bool from_previous, bool from_next) {
  const Timer timer(waiting_s_);
  std::vector<Tensor> sends;
  std::vector<int> to, from;
  if (to_next.defined()) {
    sends.push_back(to_next.detach().contiguous());
    to.push_back(next_);
  }
  if (to_previous.defined()) {
    sends.push_back(to_previous.contiguous());
    to.push_back(previous_);
  }
  if (from_previous) from.push_back(previous_);
  if (from_next) from.push_back(next_);
  if (sends.empty() && from.empty()) return {};
  const std::vector<Tensor> got = dist::exchange(sends, to, from, group_, kStepTag);
  Tensor activation = from_previous ? received_leaf(got.front()) : Tensor();
  Tensor grad = from_next ? got.back() : Tensor();
  return {activation, grad};
}

}  // namespace weave::parallel::detail
