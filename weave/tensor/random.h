#pragma once
// Seeded random number generation: the same seed gives the same numbers on every run.
#include <cstdint>
#include <random>

namespace weave {

/// A seedable generator (64-bit Mersenne Twister). Tensors are generated on the host, so a
/// seed produces the same values on every device.
class Generator {
 public:
  explicit Generator(uint64_t seed = 0x5eedULL) : engine_(seed) {}
  void seed(uint64_t s) { engine_.seed(s); }
  std::mt19937_64& engine() { return engine_; }
  /// Uniform in [0, 1).
  double uniform() { return std::uniform_real_distribution<double>(0.0, 1.0)(engine_); }
  double normal() { return std::normal_distribution<double>(0.0, 1.0)(engine_); }
  /// Uniform integer in [low, high).
  int64_t integer(int64_t low, int64_t high) {
    return std::uniform_int_distribution<int64_t>(low, high - 1)(engine_);
  }

 private:
  std::mt19937_64 engine_;
};

/// The process-wide default generator used when an op is given none.
Generator& default_generator();
/// Seeds the default generator.
void manual_seed(uint64_t seed);

}  // namespace weave
