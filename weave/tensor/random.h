#pragma once
// Seeded random number generation: the same seed gives the same numbers on every run.
#include <array>
#include <cstdint>
#include <random>
#include <string_view>

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

/// Counter-based random numbers (Philox4x32-10, Salmon et al., SC 2011): the 128 bits at
/// (key, counter) depend on nothing else, so any range of a stream is drawn directly, in any
/// order, on any rank: element i of a parameter drawn by name is the same bits whether one
/// process draws the whole tensor or a rank draws only its slice (nn::DeferredInit).
std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);
/// The key of the stream that `name` (a parameter's name) draws from under `seed`.
uint64_t stream_key(uint64_t seed, std::string_view name);
/// Uniform in [0, 1) with 53 random bits, at position `counter` of stream `key`.
double counter_uniform(uint64_t key, uint64_t counter);
/// Standard normal at position `counter` of stream `key` (Box-Muller on the position's bits).
double counter_normal(uint64_t key, uint64_t counter);

/// The process-wide default generator used when an op is given none.
Generator& default_generator();
/// Seeds the default generator.
void manual_seed(uint64_t seed);

}  // namespace weave
