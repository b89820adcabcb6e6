// weave's CUDA kernels on one GPU: each fused kernel and reduction as a fraction of the
// device-to-device copy bandwidth measured in the same run, and tensor-core attention's
// forward + backward time (bench/kernels/torch_gpu_kernels.py times the same work in PyTorch;
// scripts/gpu-check.sh puts the two side by side).
//   bench_gpu_kernels [--trials 7] [--only NAME] [--enqueue]
// Prints `kernel=NAME us=MEDIAN bytes=MOVED copy_fraction=F` per kernel (us: the median over
// trials of the mean over a batch of calls, timed between device synchronizations). --enqueue
// also prints `enqueue=NAME host_us=H backlog_us=B`: the host time of a call made behind B µs of
// queued copies. H far below B: the call waited for nothing; H near B: it synchronized.
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>

#include "bench_util.h"
#include "weave/kernels/kernels.h"
#include "weave/weave.h"

using namespace weave;

namespace {

const Device gpu = Device::cuda(0);

/// Median over trials of the mean time of `calls` calls of fn, in microseconds.
double time_us(const std::function<void()>& fn, int trials, int calls) {
  fn();
  cuda::synchronize(0);
  std::vector<double> us;
  for (int t = 0; t < trials; ++t) {
    const double s = bench::seconds([&] {
      for (int c = 0; c < calls; ++c) fn();
      cuda::synchronize(0);
    });
    us.push_back(1e6 * s / calls);
  }
  return bench::median(us);
}

struct Row {
  std::string name;
  double bytes;  // moved by one call (0: attention, reported by time only)
  std::function<void()> fn;
  int calls = 10;
};

}  // namespace

int main(int argc, char** argv) try {
  int trials = 7;
  bool enqueue = false;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--trials") && i + 1 < argc)
      trials = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--only") && i + 1 < argc)
      only = argv[++i];
    else if (!std::strcmp(argv[i], "--enqueue"))
      enqueue = true;
  }
  WEAVE_CHECK(cuda::is_available(), "bench_gpu_kernels", "no CUDA device");
  NoGradGuard outer_no_grad;
  Generator g(0);
  const int64_t n64m = int64_t(1) << 26;
  Tensor big = randn({n64m}, {.device = gpu}, &g), big_out = empty({n64m}, {.device = gpu});
  Tensor square = randn({8192, 8192}, {.device = gpu}, &g);
  Tensor ln_x = randn({8192, 768}, {.dtype = kBFloat16, .device = gpu}, &g);
  Tensor ln_g = randn({8192, 768}, {.dtype = kBFloat16, .device = gpu}, &g);
  Tensor ln_w = ones({768}, {.dtype = kBFloat16, .device = gpu});
  Tensor ln_b = zeros({768}, {.dtype = kBFloat16, .device = gpu});
  // The layer norm's kernels alone, as autograd calls them (statistics in float32).
  Tensor ln_y = empty({8192, 768}, {.dtype = kBFloat16, .device = gpu});
  Tensor ln_dx = empty({8192, 768}, {.dtype = kBFloat16, .device = gpu});
  Tensor ln_dw = empty({768}, {.dtype = kBFloat16, .device = gpu});
  Tensor ln_db = empty({768}, {.dtype = kBFloat16, .device = gpu});
  Tensor ln_mean = empty({8192}, {.device = gpu}), ln_rstd = empty({8192}, {.device = gpu});
  Tensor logits = randn({4096, 32768}, {.device = gpu}, &g);
  Tensor targets = randint(0, 32768, {4096}, {.dtype = kInt64, .device = gpu}, &g);
  Tensor act = randn({8192, 3072}, {.dtype = kBFloat16, .device = gpu}, &g);
  Tensor act_bias = randn({3072}, {.dtype = kBFloat16, .device = gpu}, &g);
  Tensor param = randn({int64_t(124) << 20}, {.device = gpu}, &g).requires_grad_();
  param.set_grad(randn({int64_t(124) << 20}, {.device = gpu}, &g));
  optim::AdamW adam({param}, {.lr = 1e-4});

  auto with_grad = [](const std::function<void()>& fn) {
    return [fn] {
      EnableGradGuard enable;
      fn();
    };
  };
  std::vector<Row> rows = {
      {"copy_f32_64M", 2.0 * 4 * double(n64m), [&] { big_out.copy_(big); }},
      {"sum_f32_64M", 4.0 * double(n64m), [&] { (void)sum(big); }},
      {"rowsum_f32_8192x8192", 4.0 * 8192 * 8192, [&] { (void)sum(square, {1}); }},
      {"colsum_f32_8192x8192", 4.0 * 8192 * 8192, [&] { (void)sum(square, {0}); }},
      {"max_f32_64M", 4.0 * double(n64m), [&] { (void)max(big); }},
      {"argmax_rows_f32_8192x8192", 4.0 * 8192 * 8192, [&] { (void)argmax(square, 1); }},
      // forward reads x, writes y; backward reads g and x, writes dx (statistics are small)
      {"layer_norm_fwd_bwd_bf16_8192x768", 5.0 * 2 * 8192 * 768, with_grad([&] {
         Tensor x = ln_x.detach().requires_grad_(), w = ln_w.detach().requires_grad_();
         Tensor b = ln_b.detach().requires_grad_();
         layer_norm(x, {768}, w, b).backward(ln_g);
       })},
      {"layer_norm_kernels_bf16_8192x768", 5.0 * 2 * 8192 * 768,
       [&] {
         kernels::layer_norm(ln_x, ln_w, ln_b, 1e-5, false, ln_y, ln_mean, ln_rstd);
         kernels::layer_norm_backward(ln_g, ln_x, ln_w, ln_mean, ln_rstd, false, ln_dx, ln_dw,
                                      ln_db);
       }},
      {"softmax_f32_4096x32768", 2.0 * 4 * 4096 * 32768, [&] { (void)softmax(logits, -1); }},
      // forward reads the logits; backward reads them and writes their gradient
      {"cross_entropy_fwd_bwd_f32_4096x32768", 3.0 * 4 * 4096 * 32768, with_grad([&] {
         Tensor l = logits.detach().requires_grad_();
         cross_entropy(l, targets).backward();
       })},
      {"bias_gelu_bf16_8192x3072", 2.0 * 2 * 8192 * 3072, [&] { (void)bias_gelu(act, act_bias); }},
      // reads p, g, m, v; writes p, m, v
      {"adamw_f32_124M", 7.0 * 4 * double(int64_t(124) << 20), [&] { adam.step(); }},
  };
  struct Sdpa {
    int64_t b, h, t, d;
  };
  for (Sdpa s : {Sdpa{8, 12, 1024, 64}, Sdpa{8, 6, 1024, 128}, Sdpa{2, 12, 4096, 64},
                 Sdpa{2, 6, 4096, 128}}) {
    auto q = std::make_shared<Tensor>(
        randn({s.b, s.h, s.t, s.d}, {.dtype = kBFloat16, .device = gpu}, &g));
    auto k = std::make_shared<Tensor>(
        randn({s.b, s.h, s.t, s.d}, {.dtype = kBFloat16, .device = gpu}, &g));
    auto v = std::make_shared<Tensor>(
        randn({s.b, s.h, s.t, s.d}, {.dtype = kBFloat16, .device = gpu}, &g));
    auto grad = std::make_shared<Tensor>(
        randn({s.b, s.h, s.t, s.d}, {.dtype = kBFloat16, .device = gpu}, &g));
    const std::string name =
        fmt::format("sdpa_causal_fwd_bwd_bf16_b{}_h{}_t{}_d{}", s.b, s.h, s.t, s.d);
    rows.push_back({name, 0, with_grad([=] {
                      Tensor qq = q->detach().requires_grad_(), kk = k->detach().requires_grad_();
                      Tensor vv = v->detach().requires_grad_();
                      scaled_dot_product_attention(qq, kk, vv, {.causal = true}).backward(*grad);
                    }),
                    5});
  }
  double copy_bandwidth = 0;
  for (const Row& row : rows) {
    if (!only.empty() && row.name.find(only) == std::string::npos && row.name != rows[0].name)
      continue;
    const double us = time_us(row.fn, trials, row.calls);
    if (row.name == rows[0].name) copy_bandwidth = row.bytes / us;
    if (row.bytes > 0)
      std::printf("kernel=%s us=%.1f bytes=%.0f gbps=%.0f copy_fraction=%.3f\n", row.name.c_str(),
                  us, row.bytes, row.bytes / us / 1e3, row.bytes / us / copy_bandwidth);
    else
      std::printf("kernel=%s us=%.1f\n", row.name.c_str(), us);
    if (enqueue) {
      const double backlog = time_us([&] { big_out.copy_(big); }, 1, 20) * 20;
      for (int c = 0; c < 20; ++c) big_out.copy_(big);
      const double host = 1e6 * bench::seconds(row.fn);
      cuda::synchronize(0);
      std::printf("enqueue=%s host_us=%.1f backlog_us=%.0f\n", row.name.c_str(), host, backlog);
    }
    std::fflush(stdout);
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}
