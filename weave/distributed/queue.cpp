// Work handles and the group accessors.
#include "weave/distributed/queue.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include <time.h>

#include "weave/distributed/runtime.h"

namespace weave::dist {

int64_t detail::now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int64_t detail::coarse_now_ns() {
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC_COARSE, &now);  // steady_clock's clock, read at its last tick
  return int64_t(now.tv_sec) * 1000000000 + now.tv_nsec;
}

namespace {

// A posted isend completes by polling (the watchdog sees only ops running on a queue, so the
// timeout is enforced here); the caller holds the state's lock.
void finish_pending_send(Work::State& s) {
  const int64_t start = detail::now_ns(), limit = detail::runtime().timeout_ns;
  while (!s.pending->done()) {
    if (detail::now_ns() - start > limit)
      detail::tear_down_after_timeout("a send (isend) to a peer");
    std::this_thread::yield();
  }
  s.pending.reset();
  s.keep_alive = Tensor();
}

}  // namespace

void Work::wait() const {
  if (!state_) return;
  std::unique_lock lock(state_->mutex);
  state_->cv.wait(lock, [&] { return state_->done; });
  if (state_->error) std::rethrow_exception(state_->error);
  if (state_->pending) finish_pending_send(*state_);
}

bool Work::is_completed() const {
  if (!state_) return true;
  std::lock_guard lock(state_->mutex);
  if (state_->done && state_->pending && state_->pending->done()) {
    state_->pending.reset();
    state_->keep_alive = Tensor();
  }
  return state_->done && !state_->pending;
}

Group::Group() : impl_(detail::live("world").world) {}
const std::vector<int>& Group::ranks() const {
  return impl_->ranks;
}
int Group::size() const {
  return static_cast<int>(impl_->ranks.size());
}
int Group::rank() const {
  return impl_->my_rank;
}
bool Group::contains(int global) const {
  return std::find(impl_->ranks.begin(), impl_->ranks.end(), global) != impl_->ranks.end();
}
int Group::global_rank(int group_rank) const {
  WEAVE_CHECK(group_rank >= 0 && group_rank < size(), "group",
              "group rank {} is outside group {} of size {}", group_rank, str(), size());
  return impl_->ranks[group_rank];
}
std::string Group::str() const {
  return fmt::format("[{}]", fmt::join(impl_->ranks, ", "));
}

void set_step(const Group& group, int64_t step) {
  group.impl()->step.store(step, std::memory_order_relaxed);
  heartbeat();
}

}  // namespace weave::dist
