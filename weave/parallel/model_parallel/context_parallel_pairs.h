#pragma once
// How ring attention's query chunks meet the key chunks passing by (internal to
// context_parallel.cpp): which pairs a causal mask and a sliding window leave to compute, with
// what options, and how many scores each computes.
#include <algorithm>
#include <cstdint>

#include "weave/kernels/attention_rules.h"
#include "weave/ops/ops.h"

namespace weave::parallel::detail {

// How query chunk a attends to key chunk b (chunks of `chunk` positions): all of it, causally
// among themselves, through the window (a sliding window whose queries sit (a - b) chunks after
// the keys), or not at all (a later chunk, or one beyond every query's window).
enum class Pair { Skip, Full, Diagonal, Windowed };
inline Pair pair_of(int64_t a, int64_t b, int64_t chunk, bool causal, int64_t window) {
  if (!causal) return Pair::Full;
  if (a == b) return Pair::Diagonal;
  if (a < b) return Pair::Skip;
  if (window == 0) return Pair::Full;
  const int64_t nearest = (a - b) * chunk - (chunk - 1);  // the closest query-key distance
  return nearest >= window ? Pair::Skip : Pair::Windowed;
}

// A pair's attention options: its causal rule, window and the queries' place after the keys.
inline AttentionOptions pair_options(Pair pair, int64_t a, int64_t b, int64_t chunk, double scale,
                                     int64_t window, double softcap) {
  AttentionOptions o{.scale = scale, .softcap = softcap};
  if (pair == Pair::Full) return o;
  o.causal = true;
  o.window = window;
  o.query_start = (a - b) * chunk;
  return o;
}

// The query-key scores a pair computes (its visible ones, for the ring's statistics).
inline int64_t pair_scores(const AttentionOptions& o, int64_t chunk) {
  if (!o.causal) return chunk * chunk;
  const functors::KeyRange range{true, o.query_start.value_or(0), o.window, chunk, chunk};
  int64_t total = 0;
  for (int64_t i = 0; i < chunk; ++i) total += std::max<int64_t>(0, range.end(i) - range.begin(i));
  return total;
}

}  // namespace weave::parallel::detail
