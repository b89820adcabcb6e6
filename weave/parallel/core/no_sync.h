#pragma once
// What a data-parallel wrapper's no_sync() returns: while the guard lives, that wrapper's backward
// accumulates gradients locally without communicating (gradient accumulation over
// micro-batches); the first backward after it communicates everything accumulated.
//
//   {
//     auto guard = ddp.no_sync();
//     loss_of(micro_batch_1).backward();   // local only
//   }
//   loss_of(micro_batch_2).backward();     // averages both
#include <memory>

namespace weave::parallel {

namespace detail {
class GradReadiness;
}

class NoSyncGuard {
 public:
  /// Made by the wrappers' no_sync().
  explicit NoSyncGuard(std::shared_ptr<detail::GradReadiness> readiness);
  ~NoSyncGuard();
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;

 private:
  std::shared_ptr<detail::GradReadiness> readiness_;
  bool previous_;
};

}  // namespace weave::parallel
