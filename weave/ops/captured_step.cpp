#include "weave/ops/captured_step.h"

#include "weave/autograd/grad_mode.h"
#include "weave/kernels/kernels.h"
#include "weave/tensor/cuda/device_runtime.h"

namespace weave {

namespace {
constexpr const char* kCapturedStepOp = "CapturedStep";
}

bool capturing_graph(Device device) {
  return device.is_cuda() && cuda::capturing(device.index);
}

bool capturing_graph(const Tensor& t) {
  return t.defined() && capturing_graph(t.device());
}

CapturedStep::CapturedStep(Step step, Options options) : step_(std::move(step)), options_(options) {
  WEAVE_CHECK(step_ != nullptr, kCapturedStepOp, "expected a step function, found none");
  WEAVE_CHECK(options_.warmup_calls >= 1, kCapturedStepOp,
              "warmup_calls must be at least 1, found {}: the eager calls create the gradients "
              "and optimizer state a captured step must find in place",
              options_.warmup_calls);
}

CapturedStep::~CapturedStep() = default;

void CapturedStep::check_inputs(const std::vector<Tensor>& inputs) {
  if (signature_.empty() && calls_ == 0) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      WEAVE_CHECK(inputs[i].defined(), kCapturedStepOp, "input {} is undefined", i);
      WEAVE_CHECK(inputs[i].device() == inputs.front().device(), kCapturedStepOp,
                  "input {} is on {} and input 0 on {}: a step's inputs share one device", i,
                  inputs[i].device(), inputs.front().device());
    }
    for (const Tensor& t : inputs) signature_.push_back(t.detach());
    return;
  }
  WEAVE_CHECK(inputs.size() == signature_.size(), kCapturedStepOp,
              "the step takes {} inputs (as on its first call), found {}", signature_.size(),
              inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& want = signature_[i];
    const Tensor& got = inputs[i];
    WEAVE_CHECK(got.defined() && got.shape() == want.shape() && got.dtype() == want.dtype() &&
                    got.device() == want.device(),
                kCapturedStepOp,
                "input {} is {} but the step was made for {} {} on {}; hint: a captured step "
                "replays fixed shapes: keep one CapturedStep per shape (or pad the batch)",
                i,
                got.defined() ? fmt::format("{} {} on {}", got.shape(), got.dtype(), got.device())
                              : std::string("undefined"),
                want.shape(), want.dtype(), want.device());
  }
}

std::vector<Tensor> CapturedStep::capture(const std::vector<Tensor>& inputs) {
  const int device = inputs.front().device().index;
  {
    NoGradGuard no_grad;
    for (const Tensor& t : inputs) static_inputs_.push_back(t.detach().clone());
  }
  cuda::begin_capture(device);
  std::vector<Tensor> outputs;
  try {
    outputs = step_(static_inputs_);
  } catch (...) {
    cuda::abort_capture(device);
    static_inputs_.clear();
    throw;
  }
  std::shared_ptr<cuda::CapturedGraph> graph = cuda::end_capture(device);
  for (size_t i = 0; i < outputs.size(); ++i)
    WEAVE_CHECK(!outputs[i].defined() || outputs[i].device() == inputs.front().device(),
                kCapturedStepOp, "output {} is on {}, not on the step's device {}", i,
                outputs[i].device(), inputs.front().device());
  static_outputs_.clear();
  for (const Tensor& t : outputs) static_outputs_.push_back(t.detach());
  graph_ = std::move(graph);
  cuda::replay(*graph_);  // the capture queued nothing that ran: this call's step runs now
  return static_outputs_;
}

std::vector<Tensor> CapturedStep::operator()(const std::vector<Tensor>& inputs) {
  check_inputs(inputs);
  ++calls_;
  const bool on_gpu = !inputs.empty() && inputs.front().device().is_cuda();
  if (!on_gpu || calls_ <= options_.warmup_calls) return step_(inputs);
  if (graph_ == nullptr) return capture(inputs);
  {
    NoGradGuard no_grad;
    for (size_t i = 0; i < inputs.size(); ++i)
      if (inputs[i].storage() != static_inputs_[i].storage() ||
          inputs[i].offset() != static_inputs_[i].offset())
        kernels::copy(inputs[i], static_inputs_[i]);
  }
  cuda::replay(*graph_);
  return static_outputs_;
}

}  // namespace weave
