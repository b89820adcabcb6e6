// Fused scaled_dot_product_attention against the same attention composed from weave's own ops
// (matmul, a causal mask, softmax, matmul), forward + backward, and the host memory each
// takes beyond its inputs (the allocator's peak, so the T x T scores count):
//   bench_attention [--t 1024] [--heads 8] [--head-dim 64] [--batch 1] [--trials 5]
//                   [--window W]   (a sliding window of W; then also against the whole causal)
//                   [--profile N]  (N fused steps only, for perf)
#include <weave/weave.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "bench_util.h"

using namespace weave;

int main(int argc, char** argv) {
  int64_t t = 1024, heads = 8, head_dim = 64, batch = 1, window = 0;
  int trials = 5, profile = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string arg = argv[i];
    const int64_t value = std::stoll(argv[i + 1]);
    if (arg == "--t") t = value;
    if (arg == "--heads") heads = value;
    if (arg == "--head-dim") head_dim = value;
    if (arg == "--batch") batch = value;
    if (arg == "--trials") trials = int(value);
    if (arg == "--profile") profile = int(value);
    if (arg == "--window") window = value;
  }
  Generator g(0);
  Tensor q = randn({batch, heads, t, head_dim}, {}, &g).requires_grad_();
  Tensor k = randn({batch, heads, t, head_dim}, {}, &g).requires_grad_();
  Tensor v = randn({batch, heads, t, head_dim}, {}, &g).requires_grad_();
  Tensor mask = triu(full({t, t}, -INFINITY), 1);  // built once, outside the timing
  if (window > 0) mask = mask + tril(full({t, t}, -INFINITY), -window);
  const double scale = 1.0 / std::sqrt(double(head_dim));
  auto fused = [&] {
    scaled_dot_product_attention(q, k, v, {.causal = true, .window = window}).sum().backward();
  };
  auto fused_causal = [&] {
    scaled_dot_product_attention(q, k, v, {.causal = true}).sum().backward();
  };
  auto composed = [&] {
    Tensor scores = matmul(q, k.transpose(-1, -2)) * scale + mask;
    matmul(softmax(scores, -1), v).sum().backward();
  };
  if (profile > 0) {
    for (int i = 0; i < profile; ++i) fused();
    return 0;
  }
  auto peak = [&](const std::function<void()>& fn) {
    cpu_empty_cache();
    const size_t before = memory_stats().in_use;
    reset_peak_memory();
    fn();
    return double(memory_stats().peak - before);
  };
  const double fused_bytes = peak(fused), composed_bytes = peak(composed);
  auto [fused_s, composed_s] = bench::alternate(fused, composed, trials);
  std::printf("attention B=%lld H=%lld T=%lld hd=%lld causal, forward+backward, %d threads\n",
              (long long)batch, (long long)heads, (long long)t, (long long)head_dim, num_threads());
  std::printf("fused     %8.2f ms  extra memory %8.2f MB\n", fused_s * 1e3, fused_bytes / 1e6);
  std::printf("composed  %8.2f ms  extra memory %8.2f MB\n", composed_s * 1e3,
              composed_bytes / 1e6);
  std::printf("speedup=%.2f memory_ratio=%.1f\n", composed_s / fused_s,
              composed_bytes / fused_bytes);
  if (window > 0) {  // the window's keys only, against every earlier key
    auto [windowed_s, causal_s] = bench::alternate(fused, fused_causal, trials);
    std::printf("window %lld: %8.2f ms, whole causal %8.2f ms, window_speedup=%.2f\n",
                (long long)window, windowed_s * 1e3, causal_s * 1e3, causal_s / windowed_s);
  }
}
