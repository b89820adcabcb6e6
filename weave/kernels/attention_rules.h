#pragma once
// What every attention kernel (CPU, CUDA, the blocked path's row passes) asks of a score, written
// once for host and device: which keys a query sees under the causal rule and a sliding window,
// and the soft-cap of the scores with its derivative.
#include <cmath>
#include <cstdint>

#include "weave/tensor/dtype.h"

namespace weave::functors {

#if defined(__CUDA_ARCH__)
#define WEAVE_ATTENTION_MATH(name) ::name
#else
#define WEAVE_ATTENTION_MATH(name) std::name
#endif

/// The keys [begin(i), end(i)) query i sees under the causal rule and a sliding window, written
/// once for every attention kernel. Positions: query i sits at query_start + i counted from key
/// 0 (Tk - Tq for the usual bottom-right alignment; ring attention's blocks pass their chunks'
/// distance). A window of w > 0 keeps the w latest keys up to the query, itself included.
struct KeyRange {
  bool causal = false;
  int64_t query_start = 0, window = 0, tq = 0, tk = 0;

  WEAVE_HD int64_t clamp_key(int64_t j) const { return j < 0 ? 0 : (j > tk ? tk : j); }
  WEAVE_HD int64_t end(int64_t i) const { return causal ? clamp_key(query_start + i + 1) : tk; }
  WEAVE_HD int64_t begin(int64_t i) const {
    return window > 0 ? clamp_key(query_start + i + 1 - window) : 0;
  }
  WEAVE_HD bool sees(int64_t i, int64_t j) const { return j >= begin(i) && j < end(i); }
  /// Whether no query is left without keys (the first and last rows are the narrowest).
  WEAVE_HD bool every_query_sees_a_key() const {
    return tq == 0 || (end(0) > begin(0) && end(tq - 1) > begin(tq - 1));
  }
  /// Queries [first_query(j), query_end(j)) see key j (clamped to [0, tq]).
  WEAVE_HD int64_t first_query(int64_t j) const {
    const int64_t first = causal ? j - query_start : 0;
    return first < 0 ? 0 : (first > tq ? tq : first);
  }
  WEAVE_HD int64_t query_end(int64_t j) const {
    const int64_t end = window > 0 ? j - query_start + window : tq;
    return end < 0 ? 0 : (end > tq ? tq : end);
  }
};

/// Gemma 2's attention-logit soft-cap: cap tanh(s / cap) (s itself when cap is 0).
template <class T>
WEAVE_HD inline T softcap(T s, T cap) {
  return cap > T(0) ? cap * WEAVE_ATTENTION_MATH(tanh)(s / cap) : s;
}
/// Its derivative from the capped value c: 1 - (c / cap)^2.
template <class T>
WEAVE_HD inline T softcap_grad(T capped, T cap) {
  return cap > T(0) ? T(1) - (capped / cap) * (capped / cap) : T(1);
}

#undef WEAVE_ATTENTION_MATH

}  // namespace weave::functors
