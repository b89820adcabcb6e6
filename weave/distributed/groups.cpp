// New groups: split from a parent's communicators in one call on its queue (new_group,
// split_group, duplicate), with the lists fingerprinted so that ranks passing different ones
// are told.
#include <algorithm>

#include "weave/distributed/runtime.h"

namespace weave::dist {

using namespace detail;

namespace {

// Splits `parent`'s communicators, one split per list of parent ranks (every member of parent
// takes part in each), in one call on parent's queue; this rank's group is the list holding it.
// `print_extra` fingerprints the lists, so ranks that pass different ones are told.
Group split_into(const Group& parent, const std::vector<std::vector<int>>& parent_ranks,
                 int64_t print_extra) {
  Runtime& r = runtime();
  Call c(Op::NewGroup, parent);
  Fingerprint print;
  print.op = static_cast<int32_t>(c.op);
  print.rank = r.rank;
  print.extra = print_extra;
  Group::Impl* g = parent.impl().get();
  auto host = std::make_shared<std::unique_ptr<Communicator>>();
  auto device = std::make_shared<std::unique_ptr<Communicator>>();
  auto mine = std::make_shared<size_t>(parent_ranks.size());
  issue(
      c, print, true,
      [g, parent_ranks, host, device, mine] {
        for (size_t k = 0; k < parent_ranks.size(); ++k) {
          auto h = g->comm->split(parent_ranks[k]);
          auto d = g->device_comm ? g->device_comm->split(parent_ranks[k]) : nullptr;
          if (h) *host = std::move(h), *device = std::move(d), *mine = k;
        }
      },
      false);
  // A non-member of a single new group still holds it (it may name it, not use it).
  const size_t listed = *mine < parent_ranks.size() ? *mine : parent_ranks.size() == 1 ? 0 : *mine;
  std::vector<int> ranks;
  if (listed < parent_ranks.size())
    for (int i : parent_ranks[listed]) ranks.push_back(parent.global_rank(i));
  auto impl = make_group(std::move(ranks), std::move(*host));
  impl->device_comm = std::move(*device);
  return Group(impl);
}

int64_t fingerprint_of(const std::vector<std::vector<int>>& lists) {
  uint64_t value = 0;  // unsigned: the products wrap around, defined
  for (const std::vector<int>& list : lists) {
    for (int v : list) value = value * 1000003 + uint64_t(v) + 1;  // same lists, same value
    value = value * 1000003 + 7;
  }
  return static_cast<int64_t>(value >> 1);
}

}  // namespace

Group duplicate(const Group& group) {
  Runtime& r = live("duplicate");
  WEAVE_CHECK(group.impl() != nullptr && group.rank() >= 0, "duplicate",
              "rank {} is not in group {}; hint: only its members duplicate it", r.rank,
              group.str());
  // Every member lists all of the group's own ranks: a split that keeps everyone, in order.
  std::vector<int> everyone(size_t(group.size()));
  for (int i = 0; i < group.size(); ++i) everyone[size_t(i)] = i;
  return split_into(group, {everyone}, 0);
}

Group new_group(const std::vector<int>& ranks) {
  Runtime& r = live("new_group");
  WEAVE_CHECK(!ranks.empty(), "new_group", "a group needs at least one rank");
  std::vector<int> sorted = ranks;
  std::sort(sorted.begin(), sorted.end());
  WEAVE_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(), "new_group",
              "ranks {} list a rank twice", ranks);
  WEAVE_CHECK(sorted.front() >= 0 && sorted.back() < r.size, "new_group",
              "ranks {} must lie in [0, {}) (the world size)", ranks, r.size);
  // World ranks are world group ranks.
  return split_into(world(), {ranks}, fingerprint_of({ranks}));
}

Group split_group(const Group& parent, const std::vector<std::vector<int>>& subgroups) {
  Runtime& r = live("split_group");
  WEAVE_CHECK(parent.impl() != nullptr && parent.rank() >= 0, "split_group",
              "rank {} is not in group {}; hint: only its members split it", r.rank, parent.str());
  std::vector<int> seen;
  std::vector<std::vector<int>> parent_ranks;
  for (const std::vector<int>& sub : subgroups) {
    WEAVE_CHECK(!sub.empty(), "split_group", "subgroups {} hold an empty one", subgroups);
    parent_ranks.emplace_back();
    for (int global : sub) {
      auto at = std::find(parent.ranks().begin(), parent.ranks().end(), global);
      WEAVE_CHECK(at != parent.ranks().end(), "split_group",
                  "rank {} of subgroups {} is not in group {}; hint: split a group into lists "
                  "of its own ranks",
                  global, subgroups, parent.str());
      parent_ranks.back().push_back(int(at - parent.ranks().begin()));
      seen.push_back(global);
    }
  }
  std::sort(seen.begin(), seen.end());
  WEAVE_CHECK(std::adjacent_find(seen.begin(), seen.end()) == seen.end(), "split_group",
              "subgroups {} list a rank twice; hint: the subgroups must be disjoint", subgroups);
  return split_into(parent, parent_ranks, fingerprint_of(subgroups));
}

}  // namespace weave::dist
