#pragma once
// Learning-rate schedules: functions of the step number, composed and applied by LRScheduler.
#include <cstdint>
#include <functional>

#include "weave/optim/optimizer.h"

namespace weave::optim {

/// Learning rate for a step number (0-based).
using Schedule = std::function<double(int64_t step)>;

/// base * gamma^(step / step_size).
Schedule step_schedule(double base_lr, int64_t step_size, double gamma = 0.1);
/// Cosine from base to min_lr over total_steps, then min_lr.
Schedule cosine_schedule(double base_lr, int64_t total_steps, double min_lr = 0);
/// Rises linearly from base/warmup_steps to `after(0)` over warmup_steps, then follows
/// after(step - warmup_steps).
Schedule linear_warmup(Schedule after, int64_t warmup_steps);

/// Sets an optimizer's learning rate from a schedule: construct (applies step 0), then call
/// step() after each optimizer step.
class LRScheduler {
 public:
  LRScheduler(Optimizer& optimizer, Schedule schedule);
  void step();
  int64_t step_count() const { return step_; }
  /// Resumes at a step count (a checkpoint's): sets the learning rate the schedule gives it.
  void set_step_count(int64_t step);
  double lr() const { return optimizer_.lr(); }

 private:
  Optimizer& optimizer_;
  Schedule schedule_;
  int64_t step_ = 0;
};

}  // namespace weave::optim
