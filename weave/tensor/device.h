#pragma once
// Where a tensor's memory lives: the host, or one CUDA device.
#include <string>
#include <string_view>

#include <fmt/format.h>

namespace weave {

enum class DeviceType : uint8_t { CPU, CUDA };

/// A device: `Device::cpu()`, `Device::cuda(1)`, or parsed from "cpu" / "cuda" / "cuda:1".
struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;

  constexpr Device() = default;
  constexpr Device(DeviceType t, int i = 0) : type(t), index(i) {}
  /// Parses "cpu", "cuda", "cuda:N"; anything else raises weave::Error.
  Device(std::string_view spec);
  Device(const char* spec) : Device(std::string_view(spec)) {}

  static constexpr Device cpu() { return {DeviceType::CPU, 0}; }
  static constexpr Device cuda(int index = 0) { return {DeviceType::CUDA, index}; }
  bool is_cpu() const { return type == DeviceType::CPU; }
  bool is_cuda() const { return type == DeviceType::CUDA; }
  std::string str() const;
  friend bool operator==(const Device& a, const Device& b) {
    return a.type == b.type && a.index == b.index;
  }
  friend bool operator!=(const Device& a, const Device& b) { return !(a == b); }
};

inline constexpr Device kCPU = Device::cpu();

}  // namespace weave

template <>
struct fmt::formatter<weave::Device> : fmt::formatter<std::string> {
  auto format(const weave::Device& d, fmt::format_context& ctx) const {
    return fmt::formatter<std::string>::format(d.str(), ctx);
  }
};
