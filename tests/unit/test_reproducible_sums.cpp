// Binned sums (one per element) and exact sums (one per scalar): the same bits in any order and
// any grouping of the terms, within their documented error of the exact sum (long double on
// values whose exact sum it holds), and NaN where a term is not finite.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "weave/kernels/common/binned.h"
#include "weave/kernels/kernels.h"
#include "weave/weave.h"

using namespace weave;
namespace common = weave::kernels::common;

namespace {

// Binned sums of `terms` rows (each [n]) in the groups given: each group summed alone (a rank's
// micro-batches, in its order), then the groups aligned to the largest window and added as
// integers (the ranks' all_reduce), then divided by `divisor`.
std::vector<float> grouped_sum(const std::vector<std::vector<float>>& terms,
                               const std::vector<std::vector<size_t>>& groups, double divisor) {
  const int64_t n = int64_t(terms.front().size());
  std::vector<Tensor> windows, limbs;
  for (const auto& group : groups) {
    Tensor window = zeros({n}, {.dtype = kUInt8}), limb = zeros({2 * n}, {.dtype = kInt64});
    for (size_t t : group) kernels::binned_add(from_vector(terms[t], {n}), window, limb);
    windows.push_back(window), limbs.push_back(limb);
  }
  std::vector<uint8_t> most(size_t(n), 0);
  for (const Tensor& w : windows) {
    const std::vector<uint8_t> values = w.to_vector<uint8_t>();
    for (size_t i = 0; i < most.size(); ++i) most[i] = std::max(most[i], values[i]);
  }
  const Tensor target = from_vector(most, {n});
  std::vector<int64_t> total(size_t(2 * n), 0);
  for (size_t g = 0; g < groups.size(); ++g) {
    kernels::binned_raise(windows[g], limbs[g], target);
    const std::vector<int64_t> values = limbs[g].to_vector<int64_t>();
    for (size_t i = 0; i < total.size(); ++i) total[i] += values[i];
  }
  Tensor out = empty({n});
  kernels::binned_value(target, from_vector(total, {2 * n}), divisor, out);
  return out.to_vector<float>();
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Terms over a wide range of magnitudes and both signs: element i's terms span 2^-40 .. 2^40.
std::vector<std::vector<float>> wide_terms(size_t count, size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-40, 40);
  std::vector<std::vector<float>> terms(count, std::vector<float>(n));
  for (auto& row : terms)
    for (float& x : row) x = std::ldexp(mantissa(rng), exponent(rng));
  return terms;
}

}  // namespace

TEST_SUITE("reproducible_sums") {
  TEST_CASE("a binned sum has the same bits in every order and grouping of its terms") {
    const size_t count = 12, n = 4096;
    const auto terms = wide_terms(count, n, 7);
    std::vector<size_t> order(count);
    std::iota(order.begin(), order.end(), 0);
    const std::vector<float> reference = grouped_sum(terms, {order}, double(count));
    std::mt19937 rng(3);
    // Every layout of 12 micro-batches over 1-4 ranks, in shuffled orders within each rank.
    for (int ranks = 1; ranks <= 4; ++ranks) {
      for (int trial = 0; trial < 5; ++trial) {
        std::shuffle(order.begin(), order.end(), rng);
        std::vector<std::vector<size_t>> groups(static_cast<size_t>(ranks));
        for (size_t k = 0; k < count; ++k) groups[k * size_t(ranks) / count].push_back(order[k]);
        CHECK(same_bits(grouped_sum(terms, groups, double(count)), reference));
      }
    }
    // Float32 addition in two orders differs on these terms: the test can tell orders apart.
    std::vector<float> forward(n, 0.0f), backward(n, 0.0f);
    for (size_t t = 0; t < count; ++t)
      for (size_t i = 0; i < n; ++i)
        forward[i] += terms[t][i], backward[i] += terms[count - 1 - t][i];
    CHECK_FALSE(same_bits(forward, backward));
  }

  TEST_CASE("a binned sum is within 2^-32 of its largest term per term of the exact sum") {
    const size_t count = 64, n = 2048;
    const auto terms = wide_terms(count, n, 11);
    std::vector<size_t> all(count);
    std::iota(all.begin(), all.end(), 0);
    const std::vector<float> sum = grouped_sum(terms, {all}, 1.0);
    for (size_t i = 0; i < n; ++i) {
      long double exact = 0, largest = 0, magnitudes = 0;  // exact: 81 bits span 2^-64..2^40
      for (size_t t = 0; t < count; ++t) {
        exact += terms[t][i];
        largest = std::max(largest, std::fabs((long double)terms[t][i]));
        magnitudes += std::fabs((long double)terms[t][i]);
      }
      // Truncation (below 2^-32 of the largest term per term), then one rounding to float.
      const long double bound =
          count * std::ldexp(largest, -32) + std::ldexp(std::fabs(exact), -24);
      CHECK(std::fabs((long double)sum[i] - exact) <= bound);
      // At least as accurate as float32 summation's bound.
      CHECK(std::fabs((long double)sum[i] - exact) <=
            (count - 1) * std::ldexp(magnitudes, -24) + std::ldexp(std::fabs(exact), -24));
    }
  }

  TEST_CASE("binned sums: cancellation, zeros and terms that are not finite") {
    const std::vector<std::vector<float>> terms = {{1e30f, 0.0f, 1.0f, 3.0f, 1.0f},
                                                   {-1e30f, 0.0f, INFINITY, -3.0f, NAN},
                                                   {0.5f, 0.0f, 1.0f, 0.0f, 1.0f}};
    const std::vector<float> sum = grouped_sum(terms, {{0, 1, 2}}, 1.0);
    CHECK(sum[0] == 0.0f);  // 0.5 lies below 1e30's window: truncated, as documented
    CHECK(sum[1] == 0.0f);
    CHECK(std::isnan(sum[2]));
    CHECK(sum[3] == 0.0f);
    CHECK(std::isnan(sum[4]));
    // Small terms first, then a large one: the window rises and drops the same bits.
    const std::vector<std::vector<float>> rising = {{0.25f}, {1.0f}, {std::ldexp(1.0f, 20)}};
    CHECK(same_bits(grouped_sum(rising, {{0, 1, 2}}, 1.0), grouped_sum(rising, {{2, 1, 0}}, 1.0)));
    CHECK(grouped_sum(rising, {{0}, {1}, {2}}, 1.0)[0] == std::ldexp(1.0f, 20) + 1.25f);
  }

  TEST_CASE("an exact sum adds every bit and rounds once") {
    dist::ExactSum sum;
    sum.add(1e100);
    sum.add(1.0);
    sum.add(-1e100);
    sum.add(std::ldexp(1.0, -1070));
    CHECK(sum.value() == 1.0);  // the subnormal lies below 1.0's last bit
    dist::ExactSum tiny;
    tiny.add(std::ldexp(1.0, -1074));
    tiny.add(std::ldexp(1.0, -1074));
    CHECK(tiny.value() == std::ldexp(1.0, -1073));
    // Squares of a tensor's elements, in two splits, against a long double sum.
    Generator g(5);
    Tensor x = randn({10000}, {}, &g);
    const std::vector<float> v = x.to_vector<float>();
    long double exact = 0;
    for (float f : v) exact += (long double)f * f;
    dist::ExactSum whole, halves;
    whole.add_power_sum({x}, 2.0);
    halves.add_power_sum({x.narrow(0, 0, 3333)}, 2.0);
    halves.add_power_sum({x.narrow(0, 3333, 6667)}, 2.0);
    CHECK(whole.limbs() == halves.limbs());
    CHECK(std::fabs(whole.value() - double(exact)) <= 1e-15 * double(exact));
    CHECK(whole.multiplied(6).divided(6).limbs() == whole.limbs());
    CHECK(whole.multiplied(3).value() == doctest::Approx(3 * whole.value()).epsilon(1e-15));
    dist::ExactSum bad;
    bad.add_power_sum({from_vector<float>({1.0f, NAN})}, 2.0);
    CHECK(std::isnan(bad.value()));
  }

  TEST_CASE("a micro-batch plan deals micro-batches by global index") {
    // 12 micro-batches of 2 items over 1-5 ranks: every index once, in order, in blocks.
    for (int ranks = 1; ranks <= 5; ++ranks) {
      std::vector<int64_t> seen;
      for (int r = 0; r < ranks; ++r) {
        parallel::MicroBatchPlan plan(24, 2, ranks, r);
        CHECK(plan.count() == 12);
        for (int64_t i = 0; i < plan.local(); ++i) {
          const auto [begin, end] = plan.items(i);
          CHECK(end - begin == 2);
          seen.push_back(begin / 2);
        }
      }
      std::vector<int64_t> expected(12);
      std::iota(expected.begin(), expected.end(), 0);
      CHECK(seen == expected);
    }
    CHECK_THROWS_WITH_AS(parallel::MicroBatchPlan(24, 5, 2, 0), doctest::Contains("multiple"),
                         Error);
    CHECK_THROWS_WITH_AS(parallel::MicroBatchPlan(4, 2, 3, 0), doctest::Contains("without one"),
                         Error);
  }
}
