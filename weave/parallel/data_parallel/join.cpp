// join(): uneven inputs across a data-parallel group, each idle rank shadowing the others' steps
// through the Joinable interface.
#include "weave/parallel/data_parallel/join.h"

#include <algorithm>

namespace weave::parallel {

namespace {

// The wrappers' and the local optimizers' parts of one shadowed step, in the listed order.
void shadow_step(const std::vector<Joinable*>& wrappers,
                 const std::vector<optim::Optimizer*>& optimizers) {
  for (size_t i = 0; i < wrappers.size(); ++i) {
    if (wrappers[i])
      wrappers[i]->shadow_join_step();
    else
      optimizers[i]->step();
  }
}

}  // namespace

void join(const std::vector<Joined>& joined, const std::function<void()>& loop) {
  std::vector<Joinable*> wrappers;
  std::vector<optim::Optimizer*> optimizers;
  for (const Joined& j : joined) {
    wrappers.push_back(j.joinable_);
    optimizers.push_back(j.optimizer_);
  }
  const auto first = std::find_if(wrappers.begin(), wrappers.end(),
                                  [](const Joinable* w) { return w != nullptr; });
  WEAVE_CHECK(
      first != wrappers.end(), "join",
      "expected a DistributedDataParallel, FullyShardedDataParallel, ZeroRedundancyOptimizer, "
      "DistributedOptimizer or DecentralizedDataParallel among the {} listed, found none; hint: "
      "a local optimizer alone has no group to join",
      joined.size());
  const dist::Group group = (*first)->join_group();
  for (const Joinable* w : wrappers)
    WEAVE_CHECK(!w || w->join_group().ranks() == group.ranks(), "join",
                "every listed wrapper must use one group, found {} and {}", group.str(),
                w->join_group().str());
  detail::JoinRegion region(group, *first);
  try {
    loop();
  } catch (...) {
    // The others learn it at their next step (or in their shadow loop) and raise too. A step
    // whose forward ran here but whose backward did not is settled first: the peers' backward
    // is issuing its collectives.
    region.start_shadowing();
    for (Joinable* w : wrappers) try {
        if (w) w->abandon_join_step();
      } catch (...) {  // the loop's own error is the one to report
      }
    if (!region.failure_counted()) try {
        region.count(/*training=*/false, /*failed=*/true);
      } catch (...) {  // a peer already out of step: the guard raised there as well
      }
    throw;
  }
  region.start_shadowing();
  for (;;) {
    bool can_shadow = true;
    for (const Joinable* w : wrappers) can_shadow = can_shadow && (!w || w->can_shadow_join_step());
    const detail::JoinCount count = region.count(/*training=*/false, /*failed=*/!can_shadow);
    WEAVE_CHECK(can_shadow, "join",
                "this rank ran out of inputs before its DistributedDataParallel's first "
                "backward or its FullyShardedDataParallel's first forward, so it cannot shadow "
                "the others' steps (their buckets and units' order are traced there); every "
                "rank of group {} stops; hint: give every rank at least one batch",
                group.str());
    if (count.failed > 0) region.fail_with_peers(count);
    if (count.training == 0) break;
    try {
      shadow_step(wrappers, optimizers);
    } catch (const Error&) {
      // Raised on every rank alike (a step some rank failed, non-finite gradients): the
      // training ranks skip the step's remaining work, and so does this one.
    }
  }
  for (Joinable* w : wrappers)
    if (w) w->check_join_ended();
}

}  // namespace weave::parallel
