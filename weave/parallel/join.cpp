// join(): uneven inputs across a data-parallel group, each idle rank shadowing the others' steps.
#include "weave/parallel/join.h"

#include <algorithm>

#include "weave/autograd/grad_mode.h"
#include "weave/parallel/agree.h"

namespace weave::parallel {

namespace {

struct Region {
  dist::Group group;
  const void* notifier;  // the wrapper whose steps count the ranks still training
  bool shadowing = false;
  bool failure_counted = false;  // a round already told every rank that some rank failed
};

thread_local Region* active_region = nullptr;

struct Count {
  int64_t training = 0, failed = 0;
};

// The per-step round: how many ranks of the group are still training, and how many failed.
Count count_ranks(const dist::Group& group, bool training, bool failed) {
  NoGradGuard no_grad;
  Tensor flags = from_vector<int64_t>({training ? 1 : 0, failed ? 1 : 0}, {2});
  dist::all_reduce(flags, dist::ReduceOp::Sum, group);
  const std::vector<int64_t> sums = flags.to_vector<int64_t>();
  return {sums[0], sums[1]};
}

[[noreturn]] void fail_with_peers(const Count& count, const dist::Group& group) {
  WEAVE_FAIL("join",
             "{} rank(s) of group {} raised inside join() or ran out of inputs before they could "
             "shadow the others (see their error), so every rank stops",
             count.failed, group.str());
}

}  // namespace

namespace detail {
void join_step_begins(const void* wrapper) {
  Region* region = active_region;
  if (region == nullptr || region->shadowing || region->notifier != wrapper) return;
  const Count count = count_ranks(region->group, /*training=*/true, /*failed=*/false);
  if (count.failed > 0) {
    region->failure_counted = true;
    fail_with_peers(count, region->group);
  }
}
}  // namespace detail

Joined::Joined(DistributedDataParallel& ddp)
    : wrapper_(&ddp),
      group_(ddp.group()),
      can_shadow_([&ddp] { return ddp.can_shadow(); }),
      shadow_([&ddp] { ddp.shadow_step(); }),
      at_end_([&ddp] {
        std::vector<Tensor> params;
        for (const Tensor& p : ddp.module().parameters()) params.push_back(p);
        parallel::detail::check_same_lines(
            parallel::detail::describe_values(params), ddp.group(), "join",
            "the parameters' values after join()",
            "a rank that ran out of batches did not step its optimizer; list the optimizer "
            "after the DDP wrapper: parallel::join({ddp, optimizer}, ...)");
      }),
      abandon_([&ddp] { ddp.settle_abandoned_step(); }) {}

Joined::Joined(FullyShardedDataParallel& fsdp)
    : wrapper_(&fsdp),
      group_(fsdp.group()),
      can_shadow_([&fsdp] { return fsdp.can_shadow(); }),
      shadow_([&fsdp] { fsdp.shadow_step(); }),
      at_end_([] {}),
      abandon_([&fsdp] { fsdp.settle_abandoned_step(); }) {}

// ZeRO and DistributedOptimizer average the gradients in step() itself: a rank out of inputs
// steps with none (each takes part with zeros).
template <class AveragingOptimizer>
Joined::Joined(AveragingOptimizer& optimizer, const dist::Group& group)
    : wrapper_(&optimizer),
      group_(group),
      can_shadow_([] { return true; }),
      shadow_([&optimizer] {
        optimizer.zero_grad(/*set_to_none=*/true);
        optimizer.step();
      }),
      at_end_([] {}) {}

Joined::Joined(ZeroRedundancyOptimizer& zero) : Joined(zero, zero.group()) {}

Joined::Joined(DistributedOptimizer& optimizer) : Joined(optimizer, optimizer.group()) {}

Joined::Joined(optim::Optimizer& optimizer)
    : wrapper_(&optimizer),
      can_shadow_([] { return true; }),
      shadow_([&optimizer] { optimizer.step(); }),
      at_end_([] {}) {}

void join(const std::vector<Joined>& joined, const std::function<void()>& loop) {
  const auto first = std::find_if(joined.begin(), joined.end(),
                                  [](const Joined& j) { return j.group_.has_value(); });
  WEAVE_CHECK(
      first != joined.end(), "join",
      "expected a DistributedDataParallel, FullyShardedDataParallel, ZeroRedundancyOptimizer or "
      "DistributedOptimizer among the {} listed, found none; hint: a local optimizer "
      "alone has no group to join",
      joined.size());
  const dist::Group group = *first->group_;
  for (const Joined& j : joined)
    WEAVE_CHECK(!j.group_ || j.group_->ranks() == group.ranks(), "join",
                "every listed wrapper must use one group, found {} and {}", group.str(),
                j.group_->str());
  WEAVE_CHECK(active_region == nullptr, "join", "join() regions do not nest");
  Region region{group, first->wrapper_};
  active_region = &region;
  struct Leave {
    ~Leave() { active_region = nullptr; }
  } leave;

  try {
    loop();
  } catch (...) {
    // The others learn it at their next step (or in their shadow loop) and raise too. A step
    // whose forward ran here but whose backward did not is settled first: the peers' backward
    // is issuing its collectives.
    region.shadowing = true;
    for (const Joined& j : joined) try {
        j.abandon_();
      } catch (...) {  // the loop's own error is the one to report
      }
    if (!region.failure_counted) try {
        count_ranks(group, /*training=*/false, /*failed=*/true);
      } catch (...) {  // a peer already out of step: the guard raised there as well
      }
    throw;
  }
  region.shadowing = true;
  for (;;) {
    bool can_shadow = true;
    for (const Joined& j : joined) can_shadow = can_shadow && j.can_shadow_();
    const Count count = count_ranks(group, /*training=*/false, /*failed=*/!can_shadow);
    WEAVE_CHECK(can_shadow, "join",
                "this rank ran out of inputs before its DistributedDataParallel's first "
                "backward or its FullyShardedDataParallel's first forward, so it cannot shadow "
                "the others' steps (their buckets and units' order are traced there); every "
                "rank of group {} stops; hint: give every rank at least one batch",
                group.str());
    if (count.failed > 0) fail_with_peers(count, group);
    if (count.training == 0) break;
    try {
      for (const Joined& j : joined) j.shadow_();
    } catch (const Error&) {
      // Raised on every rank alike (a step some rank failed, non-finite gradients): the
      // training ranks skip the step's remaining work, and so does this one.
    }
  }
  for (const Joined& j : joined) j.at_end_();
}

}  // namespace weave::parallel
