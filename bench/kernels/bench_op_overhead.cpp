// The host cost of an op: tiny tensors ([4, 64] float32), so that what a call costs is the
// framework's own work (checks, dispatch, autograd's graph, allocation and, on a GPU, the kernel
// launches) rather than arithmetic. On a GPU the calls queue far faster than the device runs
// them only if the host path is short; a model of small layers is bound by it.
// Prints `op=NAME us=MEDIAN` per op: the median over trials of the mean over a batch of calls
// (on CUDA, timed between device synchronizations). bench/kernels/torch_op_overhead.py is the
// PyTorch peer, bench/kernels/compare_op_overhead.sh runs both on one core.
//   bench_op_overhead [--device cpu|cuda] [--trials 7] [--calls 2000]
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "bench_util.h"
#include "weave/weave.h"

using namespace weave;

namespace {

struct Row {
  std::string name;
  std::function<void()> fn;
};

/// Fresh leaves requiring grad that share `t`'s storage: a step's parameters, no copy.
Tensor leaf_of(const Tensor& t) {
  return t.detach().requires_grad_();
}

}  // namespace

int main(int argc, char** argv) try {
  int trials = 7, calls = 2000;
  Device device = kCPU;
  for (int i = 1; i + 1 < argc; ++i) {
    if (!std::strcmp(argv[i], "--trials")) trials = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--calls")) calls = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--device"))
      device = std::strcmp(argv[++i], "cuda") ? kCPU : Device::cuda(0);
  }
  WEAVE_CHECK(!device.is_cuda() || cuda::is_available(), "bench_op_overhead", "no CUDA device");
  Generator g(0);
  const TensorOptions on{.device = device};
  const Tensor x = randn({4, 64}, on, &g), y = randn({4, 64}, on, &g);
  const Tensor w1 = randn({64, 64}, on, &g), b1 = randn({64}, on, &g);
  const Tensor w2 = randn({64, 64}, on, &g), b2 = randn({64}, on, &g);
  const Tensor gamma = ones({64}, on), beta = zeros({64}, on);
  const std::vector<Row> rows = {
      {"add_nograd",
       [&] {
         NoGradGuard n;
         (void)(x + y);
       }},
      {"linear_nograd",
       [&] {
         NoGradGuard n;
         (void)linear(x, w1, b1);
       }},
      {"layer_norm_nograd",
       [&] {
         NoGradGuard n;
         (void)layer_norm(x, {64}, gamma, beta);
       }},
      {"softmax_nograd",
       [&] {
         NoGradGuard n;
         (void)softmax(x, -1);
       }},
      // forward and backward of one op: its node, three gradients for fresh leaves
      {"layer_norm_fwd_bwd",
       [&] { layer_norm(leaf_of(x), {64}, leaf_of(gamma), leaf_of(beta)).backward(y); }},
      // a two-layer MLP's step: linear, gelu, linear and sum, four parameter gradients
      {"mlp_fwd_bwd",
       [&] {
         Tensor a = leaf_of(w1), c = leaf_of(b1), d = leaf_of(w2), e = leaf_of(b2);
         sum(linear(gelu(linear(x, a, c)), d, e)).backward();
       }},
  };
  auto sync = [&] {
    if (device.is_cuda()) cuda::synchronize(device.index);
  };
  for (const Row& row : rows) {
    row.fn();
    sync();
    std::vector<double> us;
    for (int t = 0; t < trials; ++t) {
      const double s = bench::seconds([&] {
        for (int c = 0; c < calls; ++c) row.fn();
        sync();
      });
      us.push_back(1e6 * s / calls);
    }
    std::printf("op=%s device=%s us=%.2f\n", row.name.c_str(), device.is_cuda() ? "cuda" : "cpu",
                bench::median(us));
    std::fflush(stdout);
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}
