// The join region: the per-step count of ranks still training, shared by join() and the wrappers'
// steps.
#include "weave/parallel/core/joinable.h"

#include "weave/parallel/core/agree.h"

namespace weave::parallel::detail {

namespace {
thread_local JoinRegion* active_region = nullptr;
}  // namespace

JoinRegion::JoinRegion(dist::Group group, const Joinable* notifier)
    : group_(std::move(group)), notifier_(notifier) {
  WEAVE_CHECK(active_region == nullptr, "join", "join() regions do not nest");
  active_region = this;
}

JoinRegion::~JoinRegion() {
  active_region = nullptr;
}

bool in_join_region() {
  return active_region != nullptr;
}

JoinCount JoinRegion::count(bool training, bool failed) {
  const std::vector<std::vector<int>> ranks = ranks_where({training, failed}, group_);
  const JoinCount result{int64_t(ranks[0].size()), int64_t(ranks[1].size())};
  if (result.failed > 0) failure_counted_ = true;
  return result;
}

void JoinRegion::fail_with_peers(const JoinCount& count) {
  WEAVE_FAIL("join",
             "{} rank(s) of group {} raised inside join() or ran out of inputs before they could "
             "shadow the others (see their error), so every rank stops",
             count.failed, group_.str());
}

void join_step_begins(const Joinable* wrapper) {
  JoinRegion* region = active_region;
  if (region == nullptr || region->shadowing_ || region->notifier_ != wrapper) return;
  const JoinCount count = region->count(/*training=*/true, /*failed=*/false);
  if (count.failed > 0) region->fail_with_peers(count);
}

}  // namespace weave::parallel::detail
