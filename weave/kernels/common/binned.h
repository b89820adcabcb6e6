#pragma once
// Sums whose bits do not depend on the order or the grouping of their terms (C++17, host and
// device: both backends run the same element functions, so they agree bit for bit).
//
// Binned sums, one per element (reproducible gradient reduction). The binary point is cut into
// bins of 32 bits at fixed positions. An element's sum keeps a window of two bins: the bin of
// the leading bit of its largest term so far (the window's top) and the bin below. A term is
// truncated toward zero below the window and added as two 32-bit digits into two int64 limbs;
// when a larger term raises the window, the limbs move up a bin (truncating toward zero again,
// which composes: truncating at a bin and then at a higher one truncates at the higher one). So
// the sum of every term truncated at the final window's lowest bit is what the limbs hold,
// whichever order the terms came in and however they were grouped (a rank's micro-batches,
// then the ranks): the window of a sum of sums is the highest of their windows, and the limbs
// of sums aligned to one window add as integers. The error is below 2^-32 of the largest term,
// per term: finer than float32 summation's for up to 2^31 terms.
//
// Exact sums, one per scalar (losses, token counts, gradient norms): every bit of every term,
// in 32-bit digits over the whole float64 range, so the sum is exact and rounds once.
#include <cmath>
#include <cstdint>

#include "weave/tensor/dtype.h"

namespace weave::kernels::common {

/// Bin b (>= 1) holds the values whose leading bit is in [2^(32 b + kBinBase),
/// 2^(32 b + kBinBase + 32)): bin 1 takes float64's smallest subnormals, bin 66 its largest.
inline constexpr int kBinBits = 32;
inline constexpr int kBinBase = -1120;
/// A window with no term yet (or zeros only): its limbs are 0.
inline constexpr uint8_t kNoBin = 0;
/// A window that met a NaN or an infinity: the sum is NaN.
inline constexpr uint8_t kNotFinite = 255;

/// The position of m's leading bit (m != 0).
WEAVE_HD inline int leading_bit(uint64_t m) {
#ifdef __CUDA_ARCH__
  return 63 - __clzll(static_cast<long long>(m));
#else
  return 63 - __builtin_clzll(m);
#endif
}

/// x as (negative ? -1 : 1) m 2^e, m an integer below 2^53; false for NaN and infinity.
WEAVE_HD inline bool split_double(double x, uint64_t& m, int& e, bool& negative) {
#ifdef __CUDA_ARCH__
  const uint64_t bits = static_cast<uint64_t>(__double_as_longlong(x));
#else
  uint64_t bits;
  __builtin_memcpy(&bits, &x, sizeof bits);
#endif
  const int field = int((bits >> 52) & 0x7ff);
  negative = (bits >> 63) != 0;
  if (field == 0x7ff) return false;
  m = bits & ((uint64_t(1) << 52) - 1);
  if (field == 0) {
    e = -1074;  // subnormal (or zero: m == 0)
  } else {
    m |= uint64_t(1) << 52;
    e = field - 1075;
  }
  return true;
}

/// The lowest bit a window topped by bin `top` keeps: 2^window_low_bit(top).
WEAVE_HD inline int window_low_bit(int top) {
  return kBinBits * (top - 1) + kBinBase;
}

/// Moves an element's limbs from window `from` up to window `to` (to >= from, neither
/// kNotFinite): what falls below the new window is truncated toward zero.
WEAVE_HD inline void raise_window(int64_t& hi, int64_t& lo, int from, int to) {
  if (to == from) return;
  lo = (to - from == 1 && from != kNoBin) ? hi : 0;
  hi = 0;
}

/// Adds x to an element's binned sum (window, limbs hi and lo).
WEAVE_HD inline void binned_add_element(uint8_t& window, int64_t& hi, int64_t& lo, double x) {
  if (window == kNotFinite) return;
  uint64_t m;
  int e;
  bool negative;
  if (!split_double(x, m, e, negative)) {
    window = kNotFinite;
    return;
  }
  if (m == 0) return;
  const int top = (e + leading_bit(m) - kBinBase) / kBinBits;
  if (top > window) {
    raise_window(hi, lo, window, top);
    window = uint8_t(top);
  }
  const int shift = e - window_low_bit(window);
  const uint64_t magnitude = shift >= 0 ? m << shift : shift <= -64 ? 0 : m >> -shift;
  const int64_t high = int64_t(magnitude >> 32), low = int64_t(magnitude & 0xffffffffu);
  if (negative) {
    hi -= high;
    lo -= low;
  } else {
    hi += high;
    lo += low;
  }
}

/// An element's binned sum as a double (rounded; the same bits on either backend).
WEAVE_HD inline double binned_element_value(uint8_t window, int64_t hi, int64_t lo) {
  if (window == kNotFinite) return NAN;
  if (window == kNoBin) return 0.0;
  const int64_t carry = lo >> 32;  // floor: lo becomes a digit in [0, 2^32)
  hi += carry;
  lo -= int64_t(uint64_t(carry) << 32);
  // hi 2^32 is exact in a double once hi is rounded, so a fused multiply-add changes nothing.
  return ldexp(double(hi) * 4294967296.0 + double(lo), window_low_bit(window));
}

/// Exact sums: limb k holds digits of weight 2^(32 k + kExactBase), the last limb signed.
inline constexpr int kExactBase = -1120;
inline constexpr int kExactLimbs = 72;  // to 2^1184: float64's range and 2^160 of headroom

/// x's digits (finite x): x = the sum of digits[d] 2^(32 (k + d) + kExactBase), d < 3; false
/// for zero.
WEAVE_HD inline bool exact_digits(double x, int& k, int64_t (&digits)[3]) {
  uint64_t m;
  int e;
  bool negative;
  if (!split_double(x, m, e, negative) || m == 0) return false;
  const int position = e - kExactBase, offset = position % kBinBits;
  k = position / kBinBits;
  const uint64_t rest = m >> (kBinBits - offset);
  digits[0] = int64_t((m & ((uint64_t(1) << (kBinBits - offset)) - 1)) << offset);
  digits[1] = int64_t(rest & 0xffffffffu);
  digits[2] = int64_t(rest >> 32);
  for (int64_t& digit : digits) digit = negative ? -digit : digit;
  return true;
}

/// Adds x exactly (finite x; the caller counts what is not) into `limbs`. The limbs take 2^31
/// additions before exact_normalize must run.
WEAVE_HD inline void exact_add(int64_t* limbs, double x) {
  int k;
  int64_t digits[3];
  if (!exact_digits(x, k, digits)) return;
  for (int d = 0; d < 3; ++d) limbs[k + d] += digits[d];
}

/// Carries every limb into the next: each becomes a digit in [0, 2^32) but the last, which
/// keeps the sign. Equal sums then have equal limbs.
WEAVE_HD inline void exact_normalize(int64_t* limbs) {
  for (int k = 0; k + 1 < kExactLimbs; ++k) {
    const int64_t carry = limbs[k] >> 32;
    limbs[k] -= int64_t(uint64_t(carry) << 32);
    limbs[k + 1] += carry;
  }
}

}  // namespace weave::kernels::common
