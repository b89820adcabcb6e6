#pragma once
// What join() (parallel/data_parallel/join.h) needs of a wrapper, so that any strategy can take
// part in a region of uneven inputs without join() knowing the strategy, nor the strategy
// join(). A rank whose loop has returned shadows the others: for each step they still take, it
// runs shadow_join_step(), which issues the same collectives with zero gradients.
//
// The protocol, per step of the first listed wrapper: that wrapper calls
// detail::join_step_begins(this) as its step begins (before it numbers the step); inside a join
// region this is one small all_reduce that counts the ranks still training (and those that
// failed); a rank out of inputs answers the same all_reduce from join()'s shadow loop.
#include <memory>

#include "weave/distributed/distributed.h"

namespace weave::parallel {

class Joinable {
 public:
  virtual ~Joinable() = default;
  /// The ranks whose steps a rank out of inputs shadows.
  virtual const dist::Group& join_group() const = 0;
  /// Whether this rank can take part in a step with zero gradients now (a wrapper that traces
  /// its buckets or units in the first step cannot before it).
  virtual bool can_shadow_join_step() const { return true; }
  /// One step of the others, with zero gradients: the same collectives, in the same order.
  virtual void shadow_join_step() = 0;
  /// Once every rank's loop has returned: checks that need the whole group (raise on every
  /// rank alike).
  virtual void check_join_ended() {}
  /// When this rank's loop raised inside the region: settles a step whose forward
  /// communicated and whose backward will not run here (the peers' backward is waiting).
  virtual void abandon_join_step() {}
};

namespace detail {

/// How many ranks of a join region's group are still training, and how many failed.
struct JoinCount {
  int64_t training = 0, failed = 0;
};

/// The join region of this thread, while join() runs: the group, and the wrapper whose steps
/// count the ranks still training. Regions do not nest.
class JoinRegion {
 public:
  JoinRegion(dist::Group group, const Joinable* notifier);
  ~JoinRegion();
  JoinRegion(const JoinRegion&) = delete;
  JoinRegion& operator=(const JoinRegion&) = delete;
  /// From here on this rank answers the per-step rounds itself (its loop has returned or
  /// raised).
  void start_shadowing() { shadowing_ = true; }
  /// One per-step round. Collective over the group.
  JoinCount count(bool training, bool failed);
  /// Whether a round already told every rank that some rank failed.
  bool failure_counted() const { return failure_counted_; }
  [[noreturn]] void fail_with_peers(const JoinCount& count);

 private:
  friend void join_step_begins(const Joinable* wrapper);
  dist::Group group_;
  const Joinable* notifier_;
  bool shadowing_ = false;
  bool failure_counted_ = false;
};

/// Whether this thread is inside join(): a layer whose collectives span ranks with different
/// batches (expert parallelism's all_to_all) and that no wrapper can shadow refuses to run there.
bool in_join_region();

/// Called by a Joinable as one of its steps begins (before it numbers the step): inside a join
/// region, the first listed wrapper's steps count the ranks still training. Collective over
/// the region's group then; nothing otherwise.
void join_step_begins(const Joinable* wrapper);

}  // namespace detail

}  // namespace weave::parallel
