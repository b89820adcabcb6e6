#pragma once
// Timing helpers shared by the benchmarks: alternate the contenders, report medians.
#include <algorithm>
#include <chrono>
#include <ctime>
#include <functional>
#include <vector>

namespace weave::bench {

inline double seconds(const std::function<void()>& fn) {
  auto start = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

/// CPU seconds this process (every thread) spent in fn: communication that is CPU work (shared
/// memory copies and reductions) cannot hide behind compute that already fills every core.
inline double cpu_seconds(const std::function<void()>& fn) {
  auto now = [] {
    timespec t{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
  };
  const double start = now();
  fn();
  return now() - start;
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

/// Runs a and b alternately `trials` times after one warm-up each; returns their medians.
inline std::pair<double, double> alternate(const std::function<void()>& a,
                                           const std::function<void()>& b, int trials) {
  a();
  b();
  std::vector<double> ta, tb;
  for (int i = 0; i < trials; ++i) {
    ta.push_back(seconds(a));
    tb.push_back(seconds(b));
  }
  return {median(ta), median(tb)};
}

}  // namespace weave::bench
