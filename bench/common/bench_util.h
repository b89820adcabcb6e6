#pragma once
// Timing helpers shared by the benchmarks: alternate the contenders, report medians.
#include <algorithm>
#include <chrono>
#include <ctime>
#include <functional>
#include <string>
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

/// One matrix product of a benchmark's workload: op(A) [m, k] times op(B) [k, n], op
/// transposing a stored [k, m] A or [n, k] B; the workload runs it `times` times.
struct Product {
  std::string name;
  bool transpose_a, transpose_b;
  int m, k, n;
  double times = 1;
  bool attention = false;
};

/// The matrix products of one GPT training step (compare_gpt.sh's limit): each linear's forward
/// x W^T, input gradient dY W and weight gradient dY^T x; attention's six per (sequence, head),
/// S = Q K^T, O = P V, dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q, counted at half for
/// the causal mask.
inline std::vector<Product> gpt_step_products(int layers, int dim, int heads, int context,
                                              int batch, int vocab) {
  const int tokens = batch * context, hd = dim / heads;
  std::vector<Product> out;
  auto linear = [&](int in, int features) {
    out.push_back({"fwd", false, true, tokens, in, features});
    out.push_back({"dX", false, false, tokens, features, in});
    out.push_back({"dW", true, false, features, tokens, in});
  };
  for (int l = 0; l < layers; ++l) {
    linear(dim, 3 * dim);
    linear(dim, dim);
    linear(dim, 4 * dim);
    linear(4 * dim, dim);
  }
  linear(dim, vocab);
  const double pairs = 0.5 * batch * heads * layers;
  for (Product p : {Product{"S", false, true, context, hd, context},
                    Product{"O", false, false, context, context, hd},
                    Product{"dV", true, false, context, context, hd},
                    Product{"dP", false, true, context, hd, context},
                    Product{"dQ", false, false, context, context, hd},
                    Product{"dK", true, false, context, context, hd}}) {
    p.times = pairs;
    p.attention = true;
    out.push_back(p);
  }
  return out;
}

}  // namespace weave::bench
