#pragma once
// Helpers for the benchmarks that run under mpirun.
#include <weave/weave.h>

namespace weave::bench {

/// The largest of every rank's `value` (the slowest rank's time, the highest peak). Collective.
inline double max_over_ranks(double value) {
  Tensor t = full({1}, value, {.dtype = kFloat64});
  dist::all_reduce(t, dist::ReduceOp::Max);
  return t.item<double>();
}

}  // namespace weave::bench
