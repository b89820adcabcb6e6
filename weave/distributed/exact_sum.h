#pragma once
// Sums over the ranks whose bits do not depend on how the terms are spread: every term is added
// exactly (in 32-bit digits over the whole float64 range) and the total is rounded once. A loss
// summed over micro-batches, a token count, a gradient norm over shards then come out the same
// at 1, 2, 3 or 4 ranks, which an all_reduce of doubles cannot promise (it adds in the order of
// its algorithm).
//
//   dist::ExactSum squares;
//   squares.add_power_sum(my_gradients, 2.0);   // this rank's shards, on their devices
//   squares.all_reduce(group);                  // every rank's, exactly
//   double norm = std::sqrt(squares.value());   // rounded once: the same bits everywhere
//
//   double loss = dist::exact_sum(my_loss_sum, group) / double(microbatches);
#include <cstdint>
#include <span>
#include <vector>

#include "weave/distributed/distributed.h"

namespace weave::dist {

class ExactSum {
 public:
  ExactSum();
  /// Adds `value` (a NaN or an infinity makes the sum NaN).
  void add(double value);
  /// Adds |x|^p of every element of every tensor of xs (floating, any devices): each power is
  /// rounded to a double, then added exactly.
  void add_power_sum(const std::vector<Tensor>& xs, double p);
  ExactSum& operator+=(const ExactSum& other);
  /// Makes this every rank's sum over `group` (one all_reduce of int64 limbs), summing `extra`
  /// words of the caller's in the same all_reduce (a count of ranks that failed). Collective.
  void all_reduce(const Group& group = world(), std::span<int64_t> extra = {});
  /// The sum as a double, rounded from its exact value (NaN when a term was not finite).
  double value() const;
  /// The sum divided by `divisor` (> 0) exactly, truncated toward zero: the sum of terms that
  /// `divisor` ranks each added once (replicas), counted once.
  ExactSum divided(int64_t divisor) const;
  /// The sum times `factor` (in [1, 2^31)), exactly.
  ExactSum multiplied(int64_t factor) const;
  /// The sum's limbs (kernels::common::kExactLimbs digits, normalized, then the count of
  /// terms that were not finite): equal sums have equal limbs.
  const std::vector<int64_t>& limbs() const { return limbs_; }

 private:
  void normalize();
  std::vector<int64_t> limbs_;
  int64_t pending_ = 0;  // additions since the last normalize
};

/// The sum of every rank's `value` over `group`, exact and rounded once: the same bits whichever
/// rank holds which part. Collective.
double exact_sum(double value, const Group& group = world());

}  // namespace weave::dist
