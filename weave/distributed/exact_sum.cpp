// Exact sums: kernels::common's 32-bit digits in int64 limbs, added across ranks as integers.
#include "weave/distributed/exact_sum.h"

#include <algorithm>
#include <cmath>

#include "weave/kernels/common/binned.h"
#include "weave/kernels/kernels.h"
#include "weave/optim/optimizer.h"

namespace weave::dist {

namespace {
namespace common = kernels::common;
constexpr size_t kNotFiniteWord = common::kExactLimbs;

// The highest limb that is not zero (-1: the sum is zero).
int top_limb(const std::vector<int64_t>& limbs) {
  for (int k = common::kExactLimbs - 1; k >= 0; --k)
    if (limbs[size_t(k)] != 0) return k;
  return -1;
}

void negate(std::vector<int64_t>& limbs) {
  for (int k = 0; k < common::kExactLimbs; ++k) limbs[size_t(k)] = -limbs[size_t(k)];
  common::exact_normalize(limbs.data());
}
}  // namespace

ExactSum::ExactSum() : limbs_(common::kExactLimbs + 1, 0) {}

void ExactSum::normalize() {
  common::exact_normalize(limbs_.data());
  pending_ = 0;
}

void ExactSum::add(double value) {
  if (!std::isfinite(value)) {
    ++limbs_[kNotFiniteWord];
    return;
  }
  common::exact_add(limbs_.data(), value);
  if (++pending_ >= (int64_t(1) << 30)) normalize();
}

void ExactSum::add_power_sum(const std::vector<Tensor>& xs, double p) {
  for (auto& [device, list] : optim::detail::by_device(xs)) {  // one pass per device
    for (Tensor& x : list) x = x.contiguous();
    Tensor part = zeros({common::kExactLimbs + 1}, {.dtype = kInt64, .device = device});
    kernels::exact_power_sum(list, p, part);
    ExactSum other;
    other.limbs_ = part.cpu().to_vector<int64_t>();
    *this += other;
  }
}

ExactSum& ExactSum::operator+=(const ExactSum& other) {
  normalize();
  for (size_t k = 0; k < limbs_.size(); ++k) limbs_[k] += other.limbs_[k];
  normalize();
  return *this;
}

void ExactSum::all_reduce(const Group& group, std::span<int64_t> extra) {
  normalize();
  std::vector<int64_t> words = limbs_;
  words.insert(words.end(), extra.begin(), extra.end());
  Tensor wire = from_vector(words, {int64_t(words.size())});
  dist::all_reduce(wire, ReduceOp::Sum, group);
  words = wire.to_vector<int64_t>();
  std::copy(words.begin(), words.begin() + long(limbs_.size()), limbs_.begin());
  std::copy(words.begin() + long(limbs_.size()), words.end(), extra.begin());
  normalize();
}

ExactSum ExactSum::multiplied(int64_t factor) const {
  WEAVE_CHECK(factor > 0 && factor < (int64_t(1) << 31), "ExactSum::multiplied",
              "the factor must be in [1, 2^31), found {}", factor);
  ExactSum out = *this;
  out.normalize();
  for (int k = 0; k < common::kExactLimbs; ++k) out.limbs_[size_t(k)] *= factor;
  out.normalize();
  return out;
}

double ExactSum::value() const {
  if (limbs_[kNotFiniteWord] != 0) return NAN;
  std::vector<int64_t> limbs = limbs_;
  common::exact_normalize(limbs.data());
  const int top = top_limb(limbs);
  if (top < 0) return 0.0;
  // Three limbs hold more than a double's 53 bits; the lower ones cannot change the rounding
  // by more than their share, and every rank reads the same limbs.
  double value = 0;
  const int last = std::max(0, top - 2);
  for (int k = top; k >= last; --k) value = value * 4294967296.0 + double(limbs[size_t(k)]);
  return std::ldexp(value, common::kBinBits * last + common::kExactBase);
}

ExactSum ExactSum::divided(int64_t divisor) const {
  WEAVE_CHECK(divisor > 0 && divisor < (int64_t(1) << 31), "ExactSum::divided",
              "the divisor must be in [1, 2^31), found {}", divisor);
  ExactSum out = *this;
  out.normalize();
  const int top = top_limb(out.limbs_);
  const bool negative = top >= 0 && out.limbs_[size_t(top)] < 0;
  if (negative) negate(out.limbs_);
  int64_t remainder = 0;
  for (int k = common::kExactLimbs - 1; k >= 0; --k) {
    const int64_t current = remainder * 4294967296LL + out.limbs_[size_t(k)];
    out.limbs_[size_t(k)] = current / divisor;
    remainder = current % divisor;
  }
  if (negative) negate(out.limbs_);
  return out;
}

double exact_sum(double value, const Group& group) {
  ExactSum sum;
  sum.add(value);
  sum.all_reduce(group);
  return sum.value();
}

}  // namespace weave::dist
