// Adam and AdamW: the fused step over many parameters per launch, and the capturable form
// whose per-step numbers live on the parameters' device.
#include <cmath>

#include "weave/autograd/grad_mode.h"
#include "weave/kernels/kernels.h"
#include "weave/ops/captured_step.h"
#include "weave/optim/internal.h"
#include "weave/optim/optimizer.h"
#include "weave/tensor/trace.h"

namespace weave::optim {

using detail::fuses;
using detail::state_options;

std::vector<Tensor> Adam::state() const {
  std::vector<Tensor> out;
  for (size_t i = 0; i < exp_avg_.size(); ++i)
    for (const Tensor& t : {exp_avg_[i], exp_avg_sq_[i]})
      if (t.defined()) out.push_back(t);
  return out;
}

Adam::Adam(std::vector<Tensor> params, AdamOptions options)
    : Adam(std::move(params), options, false) {}

namespace {
void check_adam_options(const AdamOptions& options) {
  WEAVE_CHECK(options.beta1 >= 0 && options.beta1 < 1 && options.beta2 >= 0 && options.beta2 < 1,
              "Adam", "betas must be in [0, 1), found ({}, {})", options.beta1, options.beta2);
  WEAVE_CHECK(options.eps >= 0, "Adam", "eps must be non-negative, found {}", options.eps);
}
}  // namespace

Adam::Adam(std::vector<Tensor> params, AdamOptions options, bool decoupled)
    : Optimizer(std::move(params), options.lr, options.weight_decay),
      options_(options),
      decoupled_(decoupled),
      exp_avg_(params_.size()),
      exp_avg_sq_(params_.size()) {
  check_adam_options(options);
}

Adam::Adam(const std::vector<ParamGroup>& groups, AdamOptions options)
    : Adam(groups, options, false) {}

Adam::Adam(const std::vector<ParamGroup>& groups, AdamOptions options, bool decoupled)
    : Optimizer(groups, options.lr),
      options_(options),
      decoupled_(decoupled),
      exp_avg_(params_.size()),
      exp_avg_sq_(params_.size()) {
  check_adam_options(options);
}

namespace {

constexpr const char* kStep = "Adam.step";

/// Raises for what a step captured in a CUDA graph cannot replay: state made now, numbers
/// kept on the host.
void check_capture(const Tensor& p, size_t i, bool state_exists, bool capturable) {
  if (!capturing_graph(p)) return;
  WEAVE_CHECK(state_exists, kStep,
              "parameter {} gets its first update while a CUDA graph captures the step: its "
              "state would be made anew at every replay; hint: run the step eagerly first "
              "(CapturedStep's warm-up calls do)",
              i);
  WEAVE_CHECK(capturable, kStep,
              "a CUDA graph captures this step, but the optimizer keeps its step count and "
              "learning rate on the host: every replay would repeat the captured step's; hint: "
              "AdamOptions{{.capturable = true}} (or AdamWOptions)");
}

}  // namespace

void Adam::step() {
  const trace::Scope trace_scope("optimizer", "Adam.step");
  check_backward_complete();
  NoGradGuard no_grad;
  ++steps_;
  const double correction1 = 1 - std::pow(options_.beta1, static_cast<double>(steps_));
  const double correction2 = 1 - std::pow(options_.beta2, static_cast<double>(steps_));
  std::vector<kernels::AdamTensors> fused;
  for (size_t i = 0; i < params_.size(); ++i) {
    Tensor& p = params_[i];
    if (!p.grad().defined()) continue;
    Tensor g = p.grad();
    const std::optional<double> uniform = uniform_decay(i);
    check_capture(p, i, exp_avg_[i].defined(), options_.capturable);
    if (!exp_avg_[i].defined()) {
      exp_avg_[i] = zeros(p.shape(), state_options(p));
      exp_avg_sq_[i] = zeros(p.shape(), state_options(p));
    }
    // Parts that decay differently (a flat shard of two groups) take their decay here.
    const double weight_decay = uniform.value_or(0);
    WEAVE_CHECK(!options_.capturable || (uniform && fuses(p, g)), kStep,
                "parameter {} ({} {}) cannot take a capturable step: its update needs contiguous "
                "storage, a gradient of its dtype and one weight decay; hint: capturable = false",
                i, p.dtype(), p.shape());
    if (!uniform && fuses(p, g) && !options_.capturable) {  // each segment as a parameter
      const Tensor flat_p = p.view({-1}), flat_g = g.view({-1}), m = exp_avg_[i].view({-1}),
                   v = exp_avg_sq_[i].view({-1});
      for (const DecaySegment& part : decay_segments(i)) {
        const int64_t n = part.end - part.begin;
        fused.push_back({flat_p.narrow(0, part.begin, n), flat_g.narrow(0, part.begin, n),
                         m.narrow(0, part.begin, n), v.narrow(0, part.begin, n),
                         part.weight_decay});
      }
      continue;
    }
    if (!uniform && decoupled_) decay_parts(i, lr_);
    if (!uniform && !decoupled_) g = add_part_decay(i, g);
    if (fuses(p, g)) {  // updated together below, many parameters per launch
      fused.push_back({p, g, exp_avg_[i], exp_avg_sq_[i], weight_decay});
      continue;
    }
    g = g.to(exp_avg_[i].dtype());
    if (weight_decay != 0) {
      if (decoupled_)
        p.mul_(1 - lr_ * weight_decay);
      else
        g = g + p * weight_decay;
    }
    exp_avg_[i].mul_(options_.beta1).add_(g, 1 - options_.beta1);
    exp_avg_sq_[i].mul_(options_.beta2).add_(g * g, 1 - options_.beta2);
    // p -= lr * m_hat / (sqrt(v_hat) + eps), with m_hat = m / c1 and v_hat = v / c2
    Tensor denom = sqrt(exp_avg_sq_[i] / correction2) + options_.eps;
    p.add_(exp_avg_[i] / denom, -lr_ / correction1);
  }
  kernels::AdamStep step{.lr = lr_,
                         .beta1 = options_.beta1,
                         .beta2 = options_.beta2,
                         .eps = options_.eps,
                         .weight_decay = 0,
                         .correction1 = correction1,
                         .correction2 = correction2,
                         .decoupled = decoupled_};
  if (options_.capturable && !fused.empty()) {
    const Tensor& scalars = device_scalars(fused.front().param.device());
    kernels::adam_advance(scalars, options_.beta1, options_.beta2);
    step.scalars = scalars.data<double>() + 1;
  }
  while (!fused.empty()) {  // one call per device
    const Device device = fused.front().param.device();
    std::vector<kernels::AdamTensors> here, rest;
    for (kernels::AdamTensors& t : fused) (t.param.device() == device ? here : rest).push_back(t);
    kernels::adam_update_many(here, step);
    for (const kernels::AdamTensors& t : here) t.param.storage()->bump_version();
    fused = std::move(rest);
  }
}

const Tensor& Adam::device_scalars(Device device) {
  if (scalars_.defined()) {
    WEAVE_CHECK(scalars_.device() == device, kStep,
                "a capturable optimizer steps parameters on one device; found {} and {}",
                scalars_.device(), device);
    return scalars_;
  }
  WEAVE_CHECK(!capturing_graph(device), kStep,
              "a capturable optimizer makes its device numbers on its first step, which a CUDA "
              "graph is capturing; hint: run the step eagerly first (CapturedStep's warm-up "
              "calls do)");
  // The step before this one: the step adds one where the update reads it.
  scalars_ = from_vector<double>({double(steps_ - 1), lr_, 0, 0}).to(device);
  return scalars_;
}

void Adam::set_lr(double lr) {
  const bool changed = lr != lr_;
  Optimizer::set_lr(lr);
  if (!scalars_.defined() || !changed) return;
  WEAVE_CHECK(!capturing_graph(scalars_), "Adam.set_lr",
              "the learning rate changes inside a captured step, whose replays would all use "
              "{}; hint: set it between calls of the CapturedStep",
              lr);
  kernels::fill(scalars_.narrow(0, 1, 1), lr);
}

std::map<std::string, double> Adam::counters() const {
  // A capturable optimizer counts on its device: replays of a captured step run no host code.
  const double steps =
      scalars_.defined() ? scalars_.narrow(0, 0, 1).item<double>() : static_cast<double>(steps_);
  return {{"step", steps}};
}

void Adam::set_counters(const std::map<std::string, double>& counters) {
  steps_ = static_cast<int64_t>(counters.at("step"));
  if (scalars_.defined()) kernels::fill(scalars_.narrow(0, 0, 1), double(steps_));
}

namespace {
AdamOptions adam_options_of(const AdamWOptions& options) {
  return {.lr = options.lr,
          .beta1 = options.beta1,
          .beta2 = options.beta2,
          .eps = options.eps,
          .weight_decay = options.weight_decay,
          .capturable = options.capturable};
}
}  // namespace

AdamW::AdamW(std::vector<Tensor> params, AdamWOptions options)
    : Adam(std::move(params), adam_options_of(options), true) {}

AdamW::AdamW(const std::vector<ParamGroup>& groups, AdamWOptions options)
    : Adam(groups, adam_options_of(options), true) {}

}  // namespace weave::optim
