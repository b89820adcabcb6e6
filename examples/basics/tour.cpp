// The README's API tour: fit y = 3x - 1 + noise with a small MLP.
#include <cstdio>

#include <weave/weave.h>
using namespace weave;

int main() {
  manual_seed(0);
  Tensor x = rand({256, 1}) * 4.0 - 2.0;             // inputs in [-2, 2)
  Tensor y = x * 3.0 - 1.0 + randn({256, 1}) * 0.1;  // noisy targets
  nn::Sequential model{std::make_shared<nn::Linear>(1, 32), nn::GELU(),
                       std::make_shared<nn::Linear>(32, 1)};
  optim::AdamW opt(model.parameters(), {.lr = 0.02, .weight_decay = 1e-4});
  for (int step = 0; step < 300; ++step) {
    Tensor loss = mse_loss(model(x), y);  // forward records the graph
    opt.zero_grad();
    loss.backward();  // gradients land in p.grad()
    opt.step();
    if (step % 100 == 0) std::printf("step %d loss %.4f\n", step, loss.item());
  }
  NoGradGuard no_grad;  // inference: no graph
  std::printf("f(1) = %.3f (expected about 2)\n", model(ones({1, 1})).item());
}
