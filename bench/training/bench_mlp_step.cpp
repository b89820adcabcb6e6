// One training step of an MLP 784-256-128-10 (batch 64, SGD), split into forward, backward and
// optimizer, against the same step written directly in Eigen. ratio = eigen_step / weave_step.
#include <cstdio>

#include <weave/weave.h>
#include "bench_util.h"
#include "weave/kernels/cpu/eigen.h"

using namespace weave;

namespace {

using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Vector = Eigen::RowVectorXf;

// The reference: forward, softmax cross-entropy, backward and SGD by hand.
struct EigenMlp {
  Matrix w1 = Matrix::Random(256, 784) * 0.03f, w2 = Matrix::Random(128, 256) * 0.06f,
         w3 = Matrix::Random(10, 128) * 0.09f;
  Vector b1 = Vector::Zero(256), b2 = Vector::Zero(128), b3 = Vector::Zero(10);

  void step(const Matrix& x, const std::vector<int64_t>& y, float lr) {
    Matrix z1 = (x * w1.transpose()).rowwise() + b1;
    Matrix h1 = z1.cwiseMax(0.0f);
    Matrix z2 = (h1 * w2.transpose()).rowwise() + b2;
    Matrix h2 = z2.cwiseMax(0.0f);
    Matrix logits = (h2 * w3.transpose()).rowwise() + b3;
    Eigen::VectorXf row_max = logits.rowwise().maxCoeff();
    Matrix p = (logits.colwise() - row_max).array().exp();
    Eigen::VectorXf denom = p.rowwise().sum();
    for (int i = 0; i < p.rows(); ++i) p.row(i) /= denom(i);
    Matrix g3 = p;
    for (int i = 0; i < g3.rows(); ++i) g3(i, y[i]) -= 1.0f;
    g3 /= float(x.rows());
    Matrix gh2 = g3 * w3;
    Matrix g2 = (z2.array() > 0).select(gh2, 0.0f);
    Matrix gh1 = g2 * w2;
    Matrix g1 = (z1.array() > 0).select(gh1, 0.0f);
    w3 -= lr * (g3.transpose() * h2);
    b3 -= lr * g3.colwise().sum();
    w2 -= lr * (g2.transpose() * h1);
    b2 -= lr * g2.colwise().sum();
    w1 -= lr * (g1.transpose() * x);
    b1 -= lr * g1.colwise().sum();
  }
};

}  // namespace

int main() {
  const int64_t batch = 64;
  const int steps = 300;
  manual_seed(0);
  Tensor x = randn({batch, 784});
  Tensor y = randint(0, 10, {batch});
  nn::Sequential model{std::make_shared<nn::Linear>(784, 256), nn::ReLU(),
                       std::make_shared<nn::Linear>(256, 128), nn::ReLU(),
                       std::make_shared<nn::Linear>(128, 10)};
  optim::SGD sgd(model.parameters(), {.lr = 0.01});

  EigenMlp reference;
  Matrix ex = Eigen::Map<const Matrix>(x.data<float>(), batch, 784);
  std::vector<int64_t> ey = y.to_vector<int64_t>();

  std::vector<double> forward, backward, optimizer, weave_total, eigen_total;
  for (int i = 0; i < steps + 10; ++i) {
    Tensor loss;
    double f = bench::seconds([&] { loss = cross_entropy(model(x), y); });
    double b = bench::seconds([&] {
      sgd.zero_grad();
      loss.backward();
    });
    double o = bench::seconds([&] { sgd.step(); });
    double e = bench::seconds([&] { reference.step(ex, ey, 0.01f); });
    if (i < 10) continue;  // warm-up
    forward.push_back(f);
    backward.push_back(b);
    optimizer.push_back(o);
    weave_total.push_back(f + b + o);
    eigen_total.push_back(e);
  }
  const double w = bench::median(weave_total), e = bench::median(eigen_total);
  std::printf(
      "name=mlp_step batch=%ld threads=%d forward_us=%.1f backward_us=%.1f "
      "optimizer_us=%.1f weave_step_us=%.1f eigen_step_us=%.1f ratio=%.3f\n",
      long(batch), num_threads(), bench::median(forward) * 1e6, bench::median(backward) * 1e6,
      bench::median(optimizer) * 1e6, w * 1e6, e * 1e6, e / w);
}
