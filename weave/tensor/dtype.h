#pragma once
// Element types, the 16-bit float formats, promotion rules and dtype dispatch.
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "weave/tensor/error.h"

#if defined(__CUDACC__)
#define WEAVE_HD __host__ __device__
#else
#define WEAVE_HD
#endif

namespace weave {

/// Element type of a tensor.
enum class DType : uint8_t { Float32, Float64, BFloat16, Float16, Int32, Int64, UInt8, Bool };

inline constexpr DType kFloat32 = DType::Float32;
inline constexpr DType kFloat64 = DType::Float64;
inline constexpr DType kBFloat16 = DType::BFloat16;
inline constexpr DType kFloat16 = DType::Float16;
inline constexpr DType kInt32 = DType::Int32;
inline constexpr DType kInt64 = DType::Int64;
inline constexpr DType kUInt8 = DType::UInt8;
inline constexpr DType kBool = DType::Bool;

/// IEEE 754 binary16. Storage and conversion type: arithmetic happens in float.
struct Half {
  uint16_t bits = 0;
  Half() = default;
  WEAVE_HD Half(float value) : bits(from_float(value)) {}
  WEAVE_HD operator float() const { return to_float(bits); }

  WEAVE_HD static float to_float(uint16_t h) {
    uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1fu;
    uint32_t mantissa = h & 0x3ffu;
    uint32_t out;
    if (exponent == 0) {
      if (mantissa == 0) {
        out = sign;
      } else {  // subnormal: renormalize
        exponent = 127 - 15 + 1;
        while ((mantissa & 0x400u) == 0) {
          mantissa <<= 1;
          --exponent;
        }
        out = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
      }
    } else if (exponent == 0x1f) {
      out = sign | 0x7f800000u | (mantissa << 13);
    } else {
      out = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
    }
    float f;
    memcpy(&f, &out, sizeof f);
    return f;
  }

  WEAVE_HD static uint16_t from_float(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t abs = x & 0x7fffffffu;
    if (abs >= 0x7f800000u)
      return static_cast<uint16_t>(sign | (abs > 0x7f800000u ? 0x7e00u : 0x7c00u));
    if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
    if (abs < 0x38800000u) {  // result is subnormal or zero
      if (abs < 0x33000000u) return static_cast<uint16_t>(sign);
      uint32_t exponent = abs >> 23;
      uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
      uint32_t shift = 126 - exponent;  // 14 + (112 - exponent) ... shift into 10-bit field
      uint32_t rounded = mantissa >> shift;
      uint32_t remainder = mantissa & ((1u << shift) - 1);
      uint32_t halfway = 1u << (shift - 1);
      if (remainder > halfway || (remainder == halfway && (rounded & 1u))) ++rounded;
      return static_cast<uint16_t>(sign | rounded);
    }
    uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u) - ((127 - 15) << 23);  // nearest-even
    return static_cast<uint16_t>(sign | (rounded >> 13));
  }
};

/// bfloat16: the top half of a float32. Storage and conversion type.
struct BFloat16 {
  uint16_t bits = 0;
  BFloat16() = default;
  WEAVE_HD BFloat16(float value) : bits(from_float(value)) {}
  WEAVE_HD operator float() const {
    uint32_t x = static_cast<uint32_t>(bits) << 16;
    float f;
    memcpy(&f, &x, sizeof f);
    return f;
  }
  WEAVE_HD static uint16_t from_float(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    if ((x & 0x7fffffffu) > 0x7f800000u)
      return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet NaN
    x += 0x7fffu + ((x >> 16) & 1u);                    // round to nearest even
    return static_cast<uint16_t>(x >> 16);
  }
};

/// C++ type <-> DType.
template <class T>
struct dtype_of;
template <>
struct dtype_of<float> {
  static constexpr DType value = kFloat32;
};
template <>
struct dtype_of<double> {
  static constexpr DType value = kFloat64;
};
template <>
struct dtype_of<BFloat16> {
  static constexpr DType value = kBFloat16;
};
template <>
struct dtype_of<Half> {
  static constexpr DType value = kFloat16;
};
template <>
struct dtype_of<int32_t> {
  static constexpr DType value = kInt32;
};
template <>
struct dtype_of<int64_t> {
  static constexpr DType value = kInt64;
};
template <>
struct dtype_of<uint8_t> {
  static constexpr DType value = kUInt8;
};
template <>
struct dtype_of<bool> {
  static constexpr DType value = kBool;
};

/// The type arithmetic on T happens in: float for the 16-bit formats, T otherwise.
template <class T>
using compute_t =
    std::conditional_t<std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>, float, T>;

/// Bytes per element.
size_t itemsize(DType dtype);
/// "float32", "int64", ...
const char* dtype_name(DType dtype);
bool is_floating(DType dtype);
/// True for the 16-bit floating dtypes, bfloat16 and float16.
inline bool is_reduced_float(DType dtype) {
  return dtype == DType::BFloat16 || dtype == DType::Float16;
}
/// Int32, Int64, UInt8 (not Bool).
bool is_integral(DType dtype);
/// The dtype of an arithmetic result with operands a and b (PyTorch's category rules:
/// bool < integers < floating; within a category the wider type; float16 with bfloat16 -> float32).
DType promote_types(DType a, DType b);
/// The dtype arithmetic on dtype happens in (compute_t's DType): float32 for the 16-bit floats.
inline DType compute_dtype(DType dtype) {
  return dtype == DType::BFloat16 || dtype == DType::Float16 ? DType::Float32 : dtype;
}
/// Float dtype used for integer inputs of floating ops (exp of int32 -> float32).
inline DType to_floating(DType dtype) {
  return is_floating(dtype) ? dtype : kFloat32;
}

template <class T>
struct type_tag {
  using type = T;
};

/// Calls fn(type_tag<T>{}) with T the C++ type of dtype.
template <class Fn>
decltype(auto) visit_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case kFloat32:
      return fn(type_tag<float>{});
    case kFloat64:
      return fn(type_tag<double>{});
    case kBFloat16:
      return fn(type_tag<BFloat16>{});
    case kFloat16:
      return fn(type_tag<Half>{});
    case kInt32:
      return fn(type_tag<int32_t>{});
    case kInt64:
      return fn(type_tag<int64_t>{});
    case kUInt8:
      return fn(type_tag<uint8_t>{});
    case kBool:
      return fn(type_tag<bool>{});
  }
  WEAVE_FAIL("dtype", "unknown dtype code {}", static_cast<int>(dtype));
}

}  // namespace weave

template <>
struct fmt::formatter<weave::DType> : fmt::formatter<const char*> {
  auto format(weave::DType d, fmt::format_context& ctx) const {
    return fmt::formatter<const char*>::format(weave::dtype_name(d), ctx);
  }
};
