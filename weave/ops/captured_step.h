#pragma once
// A training step captured once as a CUDA graph and replayed: the host cost of a step (op
// dispatch, autograd, kernel launches) is paid once, and every later step is one graph launch.
#include <functional>
#include <memory>
#include <vector>

#include "weave/ops/ops.h"

namespace weave {

namespace cuda {
class CapturedGraph;
}

struct CapturedStepOptions {
  /// Eager calls before the capture (at least 1).
  int warmup_calls = 2;
};

/// One training step, run as a CUDA graph after a few eager calls:
///
///   optim::AdamW opt(model.parameters(), {.lr = 3e-4, .capturable = true});
///   CapturedStep step([&](const std::vector<Tensor>& batch) {
///     Tensor loss = cross_entropy(model(batch[0]).flatten(0, 1), batch[1].flatten());
///     opt.zero_grad();
///     loss.backward();
///     Tensor norm = optim::clip_grad_norm_on_device_(opt.params(), 1.0);
///     opt.step();
///     return std::vector<Tensor>{loss, norm};
///   });
///   for (...) {
///     std::vector<Tensor> out = step({inputs, targets});  // one step each call
///     ...  out[0].item() when the loss is wanted (after the call, never inside the step)
///   }
///
/// Every call runs one step on its inputs. The first `warmup_calls` run the function eagerly
/// (they create what a step makes once: gradients, optimizer state, cuDNN plans); the next one
/// captures the function on the inputs' CUDA device and replays it; later calls copy their
/// inputs into the captured ones and replay: the same numbers as the eager steps, bit for bit,
/// without the host in the loop. Inputs must keep the shapes, dtypes and device of the first
/// call (a different one raises, naming it); the outputs are the captured tensors, overwritten
/// by the next call (clone what must outlive it).
///
/// What a captured step must not do, each raising while it captures: read a device value on
/// the host (.item(), .cpu(), the norm clip_grad_norm_ returns: use clip_grad_norm_on_device_),
/// draw random numbers on the host (dropout), or step an optimizer that keeps its step count on
/// the host (use Adam/AdamW with capturable = true), or create state. Collectives of a group of
/// one are captured (they communicate nothing). Index checks that read values on the host
/// (targets, token ids) run on the eager calls, not on replays.
///
/// On the CPU there is no graph: every call runs the function (with the same input checks), so
/// one program runs on both devices.
class CapturedStep {
 public:
  using Step = std::function<std::vector<Tensor>(const std::vector<Tensor>& inputs)>;
  using Options = CapturedStepOptions;

  explicit CapturedStep(Step step, Options options = {});
  ~CapturedStep();
  CapturedStep(const CapturedStep&) = delete;
  CapturedStep& operator=(const CapturedStep&) = delete;

  /// One step on `inputs` (see above); returns the step's outputs.
  std::vector<Tensor> operator()(const std::vector<Tensor>& inputs);
  /// True once calls replay a graph.
  bool captured() const { return graph_ != nullptr; }
  /// Calls made so far.
  int64_t calls() const { return calls_; }

 private:
  void check_inputs(const std::vector<Tensor>& inputs);
  std::vector<Tensor> capture(const std::vector<Tensor>& inputs);

  Step step_;
  Options options_;
  int64_t calls_ = 0;
  std::vector<Tensor> signature_;       // the first call's inputs, for their shapes and dtypes
  std::vector<Tensor> static_inputs_;   // what the graph reads
  std::vector<Tensor> static_outputs_;  // what the graph writes
  std::shared_ptr<cuda::CapturedGraph> graph_;
};

/// True while a CUDA graph captures work on t's device (never for a CPU tensor): the host must
/// not wait for that device or read its memory, and per-step numbers must live on the device.
bool capturing_graph(const Tensor& t);
bool capturing_graph(Device device);

}  // namespace weave
