// The counter-based generator: Philox4x32-10 and the draws built on it.
#include <cmath>

#include "weave/tensor/random.h"

namespace weave {

std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> c, std::array<uint32_t, 2> k) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k[0] += kWeyl0;
      k[1] += kWeyl1;
    }
    const uint64_t p0 = uint64_t(kMul0) * c[0], p1 = uint64_t(kMul1) * c[2];
    c = {uint32_t(p1 >> 32) ^ c[1] ^ k[0], uint32_t(p1), uint32_t(p0 >> 32) ^ c[3] ^ k[1],
         uint32_t(p0)};
  }
  return c;
}

uint64_t stream_key(uint64_t seed, std::string_view name) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a of the name, then mixed with the seed
  for (char ch : name) h = (h ^ uint8_t(ch)) * 1099511628211ull;
  uint64_t z = h ^ (seed + 0x9E3779B97F4A7C15ull);  // SplitMix64's finalizer
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

namespace {
std::array<uint32_t, 4> bits_at(uint64_t key, uint64_t counter) {
  return philox4x32({uint32_t(counter), uint32_t(counter >> 32), 0, 0},
                    {uint32_t(key), uint32_t(key >> 32)});
}
// 53 bits of two words, as a double in [0, 1).
double unit(uint32_t high, uint32_t low) {
  return double(((uint64_t(high) << 32) | low) >> 11) * 0x1p-53;
}
}  // namespace

double counter_uniform(uint64_t key, uint64_t counter) {
  const auto w = bits_at(key, counter);
  return unit(w[0], w[1]);
}

double counter_normal(uint64_t key, uint64_t counter) {
  const auto w = bits_at(key, counter);
  const double u1 = 1.0 - unit(w[0], w[1]);  // (0, 1]: log stays finite
  const double u2 = unit(w[2], w[3]);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

}  // namespace weave
