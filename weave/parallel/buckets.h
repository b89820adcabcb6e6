#pragma once
// Gradient buckets shared by the data-parallel wrappers: the order backward produces gradients
// in, agreed across ranks, and cut into buckets by size.
#include <vector>

#include "weave/distributed/distributed.h"

namespace weave::parallel::detail {

/// Completes a traced ready order (parameter indices) with the parameters that never became
/// ready, latest registered first, then makes every rank of the group adopt the first rank's
/// order. Returns that order; `differs_anywhere` tells (on every rank) whether some rank's own
/// order was different. Collective.
std::vector<int> agree_on_order(std::vector<int> trace, size_t parameters, const dist::Group& group,
                                bool& differs_anywhere);

/// Cuts `order` into buckets of consecutive parameters with one dtype and device, the first
/// bucket up to first_mb, the others up to mb (a parameter larger than the cap gets its own).
std::vector<std::vector<int>> cut_buckets(const std::vector<int>& order,
                                          const std::vector<Tensor>& params, double first_mb,
                                          double mb);

}  // namespace weave::parallel::detail
