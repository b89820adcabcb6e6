// A consumer of the installed package: fits y = 3x - 1 with weave, then sums a tensor over
// the ranks it was launched with (one without mpirun). Prints "consumer ok" on success. Its
// one flag goes through the installed weave/util/cli.h.
#include <weave/util/cli.h>
#include <weave/weave.h>

#include <cmath>
#include <cstdio>

#include "data/dataloader.h"
#include "tensor/tensor.h"

int main(int argc, char** argv) {
  using namespace weave;
  CLI::App app("Fits y = 3x - 1, then sums a tensor over the ranks.", "consumer");
  int steps = 200;
  app.add_option("--steps", steps, "gradient steps")->check(cli::positive());
  cli::parse_or_exit(app, argc, argv);
  dist::InitGuard guard;
  manual_seed(0);
  Tensor x = rand({consumer::kOwnBatchSize * 8, 1}) * 2.0 - 1.0;
  Tensor y = x * 3.0 - 1.0;
  nn::Linear model(1, 1);
  optim::SGD opt(model.parameters(), {.lr = 0.5});
  for (int step = 0; step < steps; ++step) {
    Tensor loss = mse_loss(model(x), y);
    opt.zero_grad();
    loss.backward();
    opt.step();
  }
  const double slope = model.weight.item(), bias = model.bias.item();
  Tensor ranks = full({1}, 1.0);
  dist::all_reduce(ranks);
  const bool ok = std::abs(slope - 3.0) < 1e-3 && std::abs(bias + 1.0) < 1e-3 &&
                  ranks.item() == dist::world_size();
  std::printf("%s; slope %.4f, bias %.4f, ranks %g\n", consumer::kOwnTensorHeader, slope, bias,
              ranks.item());
  std::printf(ok ? "consumer ok\n" : "consumer FAILED\n");
  return ok ? 0 : 1;
}
