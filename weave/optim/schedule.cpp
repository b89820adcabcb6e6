#include "weave/optim/schedule.h"

#include <cmath>
#include <numbers>

namespace weave::optim {

Schedule step_schedule(double base_lr, int64_t step_size, double gamma) {
  WEAVE_CHECK(step_size > 0, "step_schedule", "step_size must be positive, found {}", step_size);
  return [=](int64_t step) {
    return base_lr * std::pow(gamma, static_cast<double>(step / step_size));
  };
}

Schedule cosine_schedule(double base_lr, int64_t total_steps, double min_lr) {
  WEAVE_CHECK(total_steps > 0, "cosine_schedule", "total_steps must be positive, found {}",
              total_steps);
  return [=](int64_t step) {
    if (step >= total_steps) return min_lr;
    double progress = static_cast<double>(step) / static_cast<double>(total_steps);
    return min_lr + 0.5 * (base_lr - min_lr) * (1 + std::cos(std::numbers::pi * progress));
  };
}

Schedule linear_warmup(Schedule after, int64_t warmup_steps) {
  WEAVE_CHECK(warmup_steps >= 0, "linear_warmup", "warmup_steps must be non-negative, found {}",
              warmup_steps);
  return [after = std::move(after), warmup_steps](int64_t step) {
    if (step < warmup_steps)
      return after(0) * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
    return after(step - warmup_steps);
  };
}

LRScheduler::LRScheduler(Optimizer& optimizer, Schedule schedule)
    : optimizer_(optimizer), schedule_(std::move(schedule)) {
  optimizer_.set_lr(schedule_(0));
}

void LRScheduler::step() {
  optimizer_.set_lr(schedule_(++step_));
}

void LRScheduler::set_step_count(int64_t step) {
  WEAVE_CHECK(step >= 0, "LRScheduler", "step count must be non-negative, found {}", step);
  step_ = step;
  optimizer_.set_lr(schedule_(step_));
}

}  // namespace weave::optim
