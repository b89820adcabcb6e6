// The README's distributed tour: each rank owns a slice of the features and of the weights of
// a linear model; the prediction sums the slices with a differentiable all_reduce, so the
// gradient of each rank's slice flows back across ranks.  mpirun -np 2 dist_tour
#include <cstdio>

#include <weave/weave.h>
using namespace weave;
namespace F = weave::dist::functional;

int main() {
  dist::InitGuard guard;  // a world of one without mpirun
  const int r = dist::rank(), n = dist::world_size();
  manual_seed(0);  // the same data on every rank
  Tensor x = randn({64, 4 * n}), w_true = randn({4 * n, 1});
  Tensor y = matmul(x, w_true);
  Tensor x_mine = x.narrow(1, 4 * r, 4);           // this rank's features...
  Tensor w_mine = zeros({4, 1}).requires_grad_();  // ...and weights
  optim::SGD opt({w_mine}, {.lr = 0.1});
  for (int step = 0; step < 300; ++step) {
    Tensor pred = F::all_reduce_sum(matmul(x_mine, w_mine));  // differentiable collective
    Tensor loss = mse_loss(pred, y) / double(n);              // L = sum over ranks of L_r
    opt.zero_grad();
    loss.backward();  // gradients cross ranks
    opt.step();
  }
  double error = max(abs(w_mine - w_true.narrow(0, 4 * r, 4))).item();
  std::printf("rank %d of %d: max |w - w_true| = %.2e\n", r, n, error);
}
