#pragma once
// --cuda-graph: the whole training step (zero_grad, forward, loss, backward, clipping, AdamW)
// captured as one CUDA graph after two eager steps, then replayed once a step (CapturedStep).
// The loss and the norm stay on the GPU until a progress line reads them.
#include <weave/weave.h>

#include "data.h"
#include "flags.h"

#include <functional>
#include <optional>
#include <vector>

namespace gpt {

class GraphedTraining {
 public:
  /// The loss of the model's forward on inputs against targets.
  using Loss = std::function<Tensor(const nn::Inputs&, const Tensor&)>;
  /// `optimizer` must be capturable (AdamWOptions::capturable).
  GraphedTraining(Loss loss, optim::Optimizer& optimizer, const Flags& f)
      : step_([loss = std::move(loss), &optimizer, &f](const std::vector<Tensor>& in) {
          return run(loss, optimizer, f, in);
        }) {}

  /// One training step on `batch`.
  void step(const Batch& batch) {
    std::vector<Tensor> inputs{batch.inputs, batch.targets};
    if (batch.positions.defined()) inputs.insert(inputs.end(), {batch.positions, batch.documents});
    const std::vector<Tensor> out = step_(inputs);
    NoGradGuard no_grad;
    loss_sum_ = loss_sum_.defined() ? loss_sum_ + out[0].to(kFloat64) : out[0].to(kFloat64);
    norm_ = out[1].clone();
  }
  /// The losses summed since the last call (a host read: at progress lines only).
  double take_loss_sum() {
    const double sum = loss_sum_.defined() ? loss_sum_.item<double>() : 0;
    loss_sum_ = Tensor();
    return sum;
  }
  /// The last step's gradient norm, before clipping.
  double norm() const { return norm_.defined() ? norm_.item<double>() : 0; }

 private:
  static std::vector<Tensor> run(const Loss& loss_of, optim::Optimizer& optimizer, const Flags& f,
                                 const std::vector<Tensor>& in) {
    optimizer.zero_grad();
    Tensor loss;
    {
      std::optional<AutocastGuard> autocast;
      if (f.autocast) autocast.emplace(*f.autocast);
      const nn::Inputs inputs = in.size() > 2 ? nn::Inputs(in[0], in[2], in[3]) : nn::Inputs(in[0]);
      loss = loss_of(inputs, in[1]);
    }
    loss.backward();
    Tensor norm = optim::clip_grad_norm_on_device_(optimizer.params(), f.clip);
    optimizer.step();
    return {loss, norm};
  }

  CapturedStep step_;
  Tensor loss_sum_, norm_;
};

}  // namespace gpt
