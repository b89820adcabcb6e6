// Rotary position embeddings: the frequencies (with Llama 3.1's scaling) and the fused op, whose
// backward is the same kernel turning the other way.
#include <cmath>
#include <map>
#include <mutex>
#include <numbers>
#include <string>

#include "weave/autograd/engine.h"
#include "weave/ops/internal.h"

namespace weave {

using namespace detail;

namespace {

void check_scaling(const Llama3RopeScaling& s) {
  WEAVE_CHECK(s.factor > 0 && s.low_freq_factor > 0 && s.high_freq_factor > s.low_freq_factor &&
                  s.original_max_position > 0,
              "rotary_embedding",
              "Llama 3 scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor and "
              "original_max_position > 0, found factor {}, low {}, high {}, original {}",
              s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position);
}

// Turns x [B, T, H, D] (kernel dtype, unit inner stride) by positions [B, T] times frequencies,
// or back when inverse; differentiable, its backward being the opposite turn of the gradient.
Tensor turn(const Tensor& x, const Tensor& positions, const Tensor& frequencies, bool interleaved,
            bool inverse) {
  Tensor y = empty_on(x.shape(), x.dtype(), x.device());
  kernels::rotary(x, positions, frequencies, interleaved, inverse, y);
  return autograd::record(
      inverse ? "RotaryEmbeddingBackwardBackward" : "RotaryEmbeddingBackward", {x}, y, [&] {
        return [positions, frequencies, interleaved, inverse](const BackwardArgs& args) -> Grads {
          Tensor g = args.grad();
          if (g.dim() != 4 || g.strides()[3] != 1) g = g.contiguous();
          return {turn(g, positions, frequencies, interleaved, !inverse)};
        };
      });
}

}  // namespace

Tensor rotary_frequencies(int64_t rotary_dim, const RotaryOptions& options) {
  WEAVE_CHECK(rotary_dim > 0 && rotary_dim % 2 == 0, "rotary_embedding",
              "rotary_dim must be even and positive, found {}", rotary_dim);
  WEAVE_CHECK(options.base > 1, "rotary_embedding", "base must exceed 1, found {}", options.base);
  WEAVE_CHECK(options.linear_factor >= 1 && std::isfinite(options.linear_factor),
              "rotary_embedding", "linear_factor must be finite and >= 1, found {}",
              options.linear_factor);
  std::vector<double> frequencies(size_t(rotary_dim / 2));
  for (size_t i = 0; i < frequencies.size(); ++i)
    frequencies[i] = std::pow(options.base, -2.0 * double(i) / double(rotary_dim));
  if (const auto& s = options.llama3_scaling) {
    check_scaling(*s);
    const double original = double(s->original_max_position);
    const double long_wavelength = original / s->low_freq_factor;
    const double short_wavelength = original / s->high_freq_factor;
    for (double& f : frequencies) {
      const double wavelength = 2 * std::numbers::pi / f;
      if (wavelength < short_wavelength) continue;  // high frequencies: kept
      if (wavelength > long_wavelength) {           // low frequencies: slowed by factor
        f /= s->factor;
        continue;
      }
      const double smooth =
          (original / wavelength - s->low_freq_factor) / (s->high_freq_factor - s->low_freq_factor);
      f = (1 - smooth) * f / s->factor + smooth * f;
    }
  }
  for (double& f : frequencies) f /= options.linear_factor;
  return from_vector(frequencies, {int64_t(frequencies.size())});
}

namespace {

/// Small tables made on the host, kept on each CUDA device once copied there: the ops that
/// need them queue no copy (and make the host wait for none) from the second call on, which a
/// step captured in a CUDA graph requires and every GPU step profits from.
class DeviceTables {
 public:
  /// The table for `key` on `device`, made by make() (a CPU tensor) the first time.
  template <class Make>
  Tensor get(Device device, const std::string& key, const Make& make) {
    if (device.is_cpu()) return make();
    std::lock_guard lock(mutex_);
    auto [it, fresh] = tables_.try_emplace(fmt::format("{}|{}", device.index, key));
    if (fresh) it->second = make().to(device);
    return it->second;
  }

 private:
  std::mutex mutex_;
  std::map<std::string, Tensor> tables_;
};

DeviceTables& device_tables() {
  static DeviceTables* tables = new DeviceTables;  // outlives every static tensor user
  return *tables;
}

}  // namespace

Tensor position_ids(int64_t start, int64_t length, Device device) {
  WEAVE_CHECK(start >= 0 && length >= 0, "position_ids",
              "expected a start and a length >= 0, found {} and {}", start, length);
  if (device.is_cpu()) return arange(double(start), double(start + length), 1, {.dtype = kInt64});
  // One table per device, as long as the longest range asked for, rounded up to a power of 2.
  int64_t size = 1024;
  while (size < start + length) size *= 2;
  Tensor table = device_tables().get(device, fmt::format("positions {}", size),
                                     [&] { return arange(double(size), {.dtype = kInt64}); });
  return table.narrow(0, start, length);
}

Tensor rotary_embedding(const Tensor& x, const Tensor& positions, const RotaryOptions& options) {
  check_defined(x, "rotary_embedding");
  WEAVE_CHECK(x.dim() == 4, "rotary_embedding",
              "expected x [B, T, H, D], found {}; hint: heads first ([B, H, T, D]) is "
              "x.transpose(1, 2), a view",
              x.shape());
  const int64_t dim = x.size(3);
  const Tensor at =
      per_position(positions, x.size(0), x.size(1), x, "rotary_embedding", "positions");
  const int64_t rotary_dim = options.rotary_dim == 0 ? dim : options.rotary_dim;
  WEAVE_CHECK(rotary_dim <= dim, "rotary_embedding",
              "rotary_dim {} exceeds the head size {} of x {}", rotary_dim, dim, x.shape());
  const Tensor host_frequencies = rotary_frequencies(rotary_dim, options);
  const std::vector<double> values = host_frequencies.to_vector<double>();
  const std::string key(reinterpret_cast<const char*>(values.data()),
                        values.size() * sizeof(double));
  Tensor frequencies =
      device_tables().get(x.device(), "frequencies " + key, [&] { return host_frequencies; });
  // Differentiable conversions: the turn is recorded on what the kernel reads.
  const DType out_dtype = to_floating(x.dtype());
  Tensor xc = x.to(kernel_dtype(out_dtype));
  if (xc.strides()[3] != 1) xc = xc.contiguous();
  return turn(xc, at, frequencies, options.interleaved, false).to(out_dtype);
}

}  // namespace weave
