#include "weave/parallel/data_parallel/grad_scaler.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <utility>

#include "weave/autograd/grad_mode.h"
#include "weave/ops/side_loss.h"
#include "weave/parallel/core/agree.h"

namespace weave::parallel {

GradScaler::GradScaler(GradScalerOptions options) : options_(options), scale_(options.init_scale) {
  WEAVE_CHECK(std::isfinite(options.init_scale) && options.init_scale > 0, "GradScaler",
              "init_scale must be finite and > 0, found {}", options.init_scale);
  WEAVE_CHECK(options.growth_factor > 1 && std::isfinite(options.growth_factor), "GradScaler",
              "growth_factor must be > 1, found {}", options.growth_factor);
  WEAVE_CHECK(options.backoff_factor > 0 && options.backoff_factor < 1, "GradScaler",
              "backoff_factor must be in (0, 1), found {}", options.backoff_factor);
  WEAVE_CHECK(options.growth_interval > 0, "GradScaler", "growth_interval must be > 0, found {}",
              options.growth_interval);
  if (options.group)
    group_ = options.group;
  else if (dist::initialized())
    group_ = dist::world();
}

GradScaler::~GradScaler() {
  // A scaler dropped between scale() and update() (an error, a test) must not scale the attached
  // losses of whatever trains next in this process.
  if (factor_set_) set_attached_loss_gradient_factor(1.0);
}

Tensor GradScaler::scale(const Tensor& loss) const {
  WEAVE_CHECK(loss.defined() && is_floating(loss.dtype()), "GradScaler.scale",
              "expected a floating loss, found {}",
              loss.defined() ? dtype_name(loss.dtype()) : "an undefined tensor");
  if (!options_.enabled) return loss;
  // Losses the layers attach to their outputs (experts' balancing) are part of the scaled loss.
  set_attached_loss_gradient_factor(scale_);
  factor_set_ = true;
  return loss * scale_;
}

namespace {

// Divides each gradient by `scale` in place; true when every one is finite afterwards.
bool unscale_grads(const std::vector<Tensor>& grads, double scale) {
  NoGradGuard no_grad;
  for (Tensor g : grads)
    if (g.defined()) g.mul_(1.0 / scale);
  return all_finite(grads);
}

}  // namespace

bool GradScaler::agree_verdict(bool found_inf, const std::function<void()>& checks,
                               const char* op) const {
  // The scale and the growth tracker travel with the verdict, and must be the same on every
  // rank. A positive double's bits order as its value does.
  int64_t bits = 0;
  std::memcpy(&bits, &scale_, sizeof bits);
  const detail::ValueRange agreed =
      detail::check_together(checks, *group_, op, {found_inf ? 1 : 0, bits, growth_tracker_});
  if (!agreed.same(1) || !agreed.same(2)) {
    double lowest = 0, highest = 0;
    std::memcpy(&lowest, &agreed.lowest[1], sizeof lowest);
    std::memcpy(&highest, &agreed.highest[1], sizeof highest);
    WEAVE_FAIL(op,
               "ranks of group {} disagree on the loss scale: it ranges from {} to {}, the growth "
               "tracker from {} to {}; their replicas would step differently; hint: build every "
               "rank's scaler with the same options, and restore each from the same state_dict",
               group_->str(), lowest, highest, agreed.lowest[2], agreed.highest[2]);
  }
  return agreed.highest[0] != 0;
}

void GradScaler::warn_if_always_skipped() {
  ++skipped_in_a_row_;
  const int64_t window = options_.warn_after_skipped;
  if (window <= 0 || skipped_in_a_row_ != window) return;
  if (group_ && group_->rank() != 0) return;  // the verdicts are the group's: one warning
  std::fprintf(stderr,
               "[weave] GradScaler: the last %lld steps were all skipped: the gradients held inf "
               "or NaN at every scale from %g down to %g; scaling cannot fix a NaN that the "
               "data or the model produces; hint: check the inputs and the loss for NaN, and "
               "lower the learning rate\n",
               static_cast<long long>(window), scale_before_skips_,
               scale_ / options_.backoff_factor);
}

bool GradScaler::unscale_local(const std::vector<Tensor>& grads) {
  if (!options_.enabled) return true;
  const bool finite = unscale_grads(grads, scale_);
  found_inf_ = found_inf_ || !finite;
  stage_ = Stage::Stepped;
  return finite;
}

void GradScaler::unscale_(const std::vector<Tensor>& params) {
  const char* op = "GradScaler.unscale_";
  if (!options_.enabled) {
    stage_ = Stage::Unscaled;
    return;
  }
  WEAVE_CHECK(stage_ == Stage::Ready, op,
              "unscale_ was already called since the last update(); hint: call update() after "
              "each step, and unscale_ at most once per step");
  std::vector<Tensor> grads;
  bool any_grad = false;
  for (const Tensor& p : params) {
    grads.push_back(p.grad());
    any_grad = any_grad || p.grad().defined();
  }
  const bool finite = unscale_grads(grads, scale_);
  // One all_reduce carries the overflow verdict and whether some rank has no gradients (its
  // check raises there, and every other rank raises with it).
  auto checks = [&] {
    WEAVE_CHECK(any_grad, op,
                "no gradients to unscale; hint: call backward on scaler.scale(loss) on every "
                "rank before step()");
  };
  if (group_) {
    found_inf_ = agree_verdict(!finite, checks, op);
  } else {
    checks();
    found_inf_ = !finite;
  }
  agreed_ = true;
  stage_ = Stage::Unscaled;
}

bool GradScaler::step(optim::Optimizer& optimizer) {
  return step(optimizer.params(), [&] { optimizer.step(); });
}

bool GradScaler::step(const std::vector<Tensor>& params, const std::function<void()>& run_step) {
  WEAVE_CHECK(stage_ != Stage::Stepped, "GradScaler.step",
              "step() was already called since the last update(); hint: call update() after "
              "each step");
  if (stage_ == Stage::Ready) unscale_(params);
  stage_ = Stage::Stepped;
  if (options_.enabled && found_inf_) return false;
  run_step();
  return true;
}

void GradScaler::update() {
  WEAVE_CHECK(stage_ == Stage::Stepped, "GradScaler.update",
              "no step since the last update(); hint: the loop is scaler.scale(loss).backward(), "
              "scaler.step(optimizer), scaler.update()");
  stage_ = Stage::Ready;
  if (std::exchange(factor_set_, false)) set_attached_loss_gradient_factor(1.0);
  if (!options_.enabled) return;
  if (!agreed_ && group_) {  // per-bucket verdicts (decentralized): agree now
    const auto no_checks = [] {};
    found_inf_ = agree_verdict(found_inf_, no_checks, "GradScaler.update");
  }
  if (found_inf_) {
    if (skipped_in_a_row_ == 0) scale_before_skips_ = scale_;
    scale_ *= options_.backoff_factor;
    growth_tracker_ = 0;
    warn_if_always_skipped();
  } else {
    skipped_in_a_row_ = 0;
    if (++growth_tracker_ == options_.growth_interval) {
      scale_ *= options_.growth_factor;
      growth_tracker_ = 0;
    }
  }
  found_inf_ = false;
  agreed_ = false;
}

std::map<std::string, double> GradScaler::state_dict() const {
  return {{"scale", scale_}, {"growth_tracker", double(growth_tracker_)}};
}

void GradScaler::load_state_dict(const std::map<std::string, double>& state) {
  const auto scale = state.find("scale"), tracker = state.find("growth_tracker");
  WEAVE_CHECK(scale != state.end() && tracker != state.end(), "GradScaler.load_state_dict",
              "expected 'scale' and 'growth_tracker' in the state");
  WEAVE_CHECK(std::isfinite(scale->second) && scale->second > 0 && tracker->second >= 0,
              "GradScaler.load_state_dict",
              "expected a finite scale > 0 and a growth_tracker >= 0, found {} and {}",
              scale->second, tracker->second);
  scale_ = scale->second;
  growth_tracker_ = int64_t(tracker->second);
}

}  // namespace weave::parallel
