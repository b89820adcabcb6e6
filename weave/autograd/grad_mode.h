#pragma once
// Whether ops record the graph on this thread.

namespace weave::autograd {

struct GradMode {
  static bool is_enabled();
  static void set_enabled(bool enabled);
};

}  // namespace weave::autograd

namespace weave {

/// While alive, ops on this thread record no graph (like torch.no_grad()).
class NoGradGuard {
 public:
  NoGradGuard() : previous_(autograd::GradMode::is_enabled()) {
    autograd::GradMode::set_enabled(false);
  }
  ~NoGradGuard() { autograd::GradMode::set_enabled(previous_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool previous_;
};

/// While alive, ops record the graph even inside a NoGradGuard.
class EnableGradGuard {
 public:
  EnableGradGuard() : previous_(autograd::GradMode::is_enabled()) {
    autograd::GradMode::set_enabled(true);
  }
  ~EnableGradGuard() { autograd::GradMode::set_enabled(previous_); }
  EnableGradGuard(const EnableGradGuard&) = delete;
  EnableGradGuard& operator=(const EnableGradGuard&) = delete;

 private:
  bool previous_;
};

}  // namespace weave
