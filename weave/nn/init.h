#pragma once
// Parameter initialization, in place and seeded (default generator when none is given).
#include "weave/ops/ops.h"

namespace weave::nn::init {

enum class FanMode { FanIn, FanOut };

/// Fan-in and fan-out of a weight [out, in, ...].
std::pair<int64_t, int64_t> fans(const Tensor& weight);
/// Recommended gain for a nonlinearity: "linear", "relu", "leaky_relu" (with slope), "tanh",
/// "sigmoid".
double gain(const std::string& nonlinearity, double slope = 0.01);

/// U(low, high): low <= high, both finite (raises otherwise, eager or deferred).
void uniform_(Tensor& t, double low, double high, Generator* generator = nullptr);
/// N(mean, std): std >= 0, both finite (raises otherwise, eager or deferred).
void normal_(Tensor& t, double mean, double std, Generator* generator = nullptr);
/// The checks uniform_ and normal_ (and the deferred recipes) make of their arguments.
void check_uniform_range(double low, double high);
void check_normal_spread(double mean, double std);
void zeros_(Tensor& t);
void ones_(Tensor& t);
/// He et al.: U(-b, b), b = gain * sqrt(3 / fan).
void kaiming_uniform_(Tensor& t, double slope = 0, FanMode mode = FanMode::FanIn,
                      const std::string& nonlinearity = "leaky_relu",
                      Generator* generator = nullptr);
/// He et al.: N(0, gain / sqrt(fan)).
void kaiming_normal_(Tensor& t, double slope = 0, FanMode mode = FanMode::FanIn,
                     const std::string& nonlinearity = "leaky_relu",
                     Generator* generator = nullptr);
/// Glorot & Bengio: U(-b, b), b = gain * sqrt(6 / (fan_in + fan_out)).
void xavier_uniform_(Tensor& t, double gain = 1.0, Generator* generator = nullptr);
/// Glorot & Bengio: N(0, gain * sqrt(2 / (fan_in + fan_out))).
void xavier_normal_(Tensor& t, double gain = 1.0, Generator* generator = nullptr);

}  // namespace weave::nn::init
