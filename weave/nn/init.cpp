#include "weave/nn/init.h"

#include <cmath>

#include "weave/autograd/grad_mode.h"
#include "weave/nn/deferred.h"

namespace weave::nn::init {

std::pair<int64_t, int64_t> fans(const Tensor& weight) {
  WEAVE_CHECK(weight.dim() >= 2, "init", "fan in/out need a weight with at least 2 dims, found {}",
              weight.shape());
  int64_t receptive = 1;
  for (int d = 2; d < weight.dim(); ++d) receptive *= weight.shape()[d];
  return {weight.shape()[1] * receptive, weight.shape()[0] * receptive};
}

double gain(const std::string& nonlinearity, double slope) {
  if (nonlinearity == "linear" || nonlinearity == "sigmoid") return 1.0;
  if (nonlinearity == "tanh") return 5.0 / 3.0;
  if (nonlinearity == "relu") return std::sqrt(2.0);
  if (nonlinearity == "leaky_relu") return std::sqrt(2.0 / (1 + slope * slope));
  WEAVE_FAIL("init",
             "unknown nonlinearity '{}'; expected linear, sigmoid, tanh, relu or leaky_relu",
             nonlinearity);
}

void check_uniform_range(double low, double high) {
  WEAVE_CHECK(std::isfinite(low) && std::isfinite(high) && low <= high, "init.uniform_",
              "expected a finite range with low <= high, found [{}, {}); hint: uniform_(t, -b, b) "
              "with b >= 0",
              low, high);
}

void check_normal_spread(double mean, double std) {
  WEAVE_CHECK(std::isfinite(mean) && std::isfinite(std) && std >= 0, "init.normal_",
              "expected a finite mean and a finite std >= 0, found mean {} and std {}", mean, std);
}

// A deferred parameter takes the recipe instead of values: it is drawn by name when
// materialized (deferred.h), so `generator` does not apply to it.
void uniform_(Tensor& t, double low, double high, Generator* generator) {
  check_uniform_range(low, high);
  if (set_deferred_recipe(t, DeferredValues::Kind::Uniform, low, high)) return;
  NoGradGuard no_grad;
  Tensor u = rand(t.shape(), {.dtype = is_floating(t.dtype()) ? t.dtype() : kFloat64}, generator);
  t.copy_(u * (high - low) + low);
}

void normal_(Tensor& t, double mean, double std, Generator* generator) {
  check_normal_spread(mean, std);
  if (set_deferred_recipe(t, DeferredValues::Kind::Normal, mean, std)) return;
  NoGradGuard no_grad;
  Tensor n = randn(t.shape(), {.dtype = is_floating(t.dtype()) ? t.dtype() : kFloat64}, generator);
  t.copy_(n * std + mean);
}

void zeros_(Tensor& t) {
  if (set_deferred_recipe(t, DeferredValues::Kind::Constant, 0, 0)) return;
  NoGradGuard no_grad;
  t.zero_();
}
void ones_(Tensor& t) {
  if (set_deferred_recipe(t, DeferredValues::Kind::Constant, 1, 0)) return;
  NoGradGuard no_grad;
  t.fill_(1.0);
}

void kaiming_uniform_(Tensor& t, double slope, FanMode mode, const std::string& nonlinearity,
                      Generator* generator) {
  auto [fan_in, fan_out] = fans(t);
  double fan = static_cast<double>(mode == FanMode::FanIn ? fan_in : fan_out);
  double bound = gain(nonlinearity, slope) * std::sqrt(3.0 / fan);
  uniform_(t, -bound, bound, generator);
}

void kaiming_normal_(Tensor& t, double slope, FanMode mode, const std::string& nonlinearity,
                     Generator* generator) {
  auto [fan_in, fan_out] = fans(t);
  double fan = static_cast<double>(mode == FanMode::FanIn ? fan_in : fan_out);
  normal_(t, 0.0, gain(nonlinearity, slope) / std::sqrt(fan), generator);
}

void xavier_uniform_(Tensor& t, double g, Generator* generator) {
  auto [fan_in, fan_out] = fans(t);
  double bound = g * std::sqrt(6.0 / static_cast<double>(fan_in + fan_out));
  uniform_(t, -bound, bound, generator);
}

void xavier_normal_(Tensor& t, double g, Generator* generator) {
  auto [fan_in, fan_out] = fans(t);
  normal_(t, 0.0, g * std::sqrt(2.0 / static_cast<double>(fan_in + fan_out)), generator);
}

}  // namespace weave::nn::init
