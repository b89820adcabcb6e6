#pragma once
// Shapes and strides: small inline arrays, so ops allocate nothing on the heap for them.
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "weave/tensor/error.h"

namespace weave {

/// Most dimensions a tensor may have.
inline constexpr int kMaxDims = 8;

/// A fixed-capacity vector of int64 (capacity kMaxDims), used for shapes and strides.
class Dims {
 public:
  Dims() = default;
  Dims(std::initializer_list<int64_t> values) { assign(values.begin(), values.end()); }
  Dims(const int64_t* values, int n) { assign(values, values + n); }
  Dims(const std::vector<int64_t>& values) { assign(values.begin(), values.end()); }
  /// n copies of value.
  static Dims filled(int n, int64_t value) {
    Dims d;
    d.resize(n, value);
    return d;
  }

  int size() const { return size_; }
  bool empty() const { return size_ == 0; }
  int64_t* begin() { return data_; }
  int64_t* end() { return data_ + size_; }
  const int64_t* begin() const { return data_; }
  const int64_t* end() const { return data_ + size_; }
  int64_t* data() { return data_; }
  const int64_t* data() const { return data_; }
  int64_t& operator[](int i) { return data_[i]; }
  int64_t operator[](int i) const { return data_[i]; }
  int64_t back() const { return data_[size_ - 1]; }
  void push_back(int64_t v) {
    check_capacity(size_ + 1);
    data_[size_++] = v;
  }
  void insert(int pos, int64_t v) {
    check_capacity(size_ + 1);
    std::copy_backward(data_ + pos, data_ + size_, data_ + size_ + 1);
    data_[pos] = v;
    ++size_;
  }
  void erase(int pos) {
    std::copy(data_ + pos + 1, data_ + size_, data_ + pos);
    --size_;
  }
  void resize(int n, int64_t value = 0) {
    check_capacity(n);
    for (int i = size_; i < n && i < kMaxDims; ++i) data_[i] = value;
    size_ = static_cast<uint8_t>(n);
  }
  std::vector<int64_t> vec() const { return {begin(), end()}; }
  /// Product of the entries (1 for an empty Dims); raises if it overflows int64.
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < size_; ++i)
      WEAVE_CHECK(!__builtin_mul_overflow(n, data_[i], &n), "shape",
                  "{} has more elements than int64 can count; hint: check the sizes", str());
    return n;
  }
  friend bool operator==(const Dims& a, const Dims& b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end());
  }
  /// "[2, 3]".
  std::string str() const;

 private:
  template <class It>
  void assign(It first, It last) {
    check_capacity(static_cast<int>(last - first));
    size_ = static_cast<uint8_t>(last - first);
    std::copy(first, last, data_);
  }
  static void check_capacity(int n) {
    WEAVE_CHECK(n >= 0 && n <= kMaxDims, "shape",
                "a shape has at most {} dimensions (and not fewer than 0), found {}", kMaxDims, n);
  }
  int64_t data_[kMaxDims] = {};
  uint8_t size_ = 0;
};

using Shape = Dims;
using Strides = Dims;

/// Row-major strides of a contiguous tensor of this shape.
Strides contiguous_strides(const Shape& shape);
/// NumPy broadcasting of two shapes; raises an error naming op when they are incompatible.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);
/// Maps a possibly negative dim into [0, rank); raises an error naming op when out of range.
int normalize_dim(int64_t dim, int rank, const char* op);

}  // namespace weave

template <>
struct fmt::formatter<weave::Dims> : fmt::formatter<std::string> {
  auto format(const weave::Dims& d, fmt::format_context& ctx) const {
    return fmt::formatter<std::string>::format(d.str(), ctx);
  }
};
