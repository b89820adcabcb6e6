#pragma once
// Tensor: a cheap, shared handle to storage + shape + strides + offset + dtype + device, plus
// autograd metadata. Copying a Tensor copies the handle; views share storage.
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "weave/tensor/device.h"
#include "weave/tensor/dtype.h"
#include "weave/tensor/shape.h"
#include "weave/tensor/storage.h"

namespace weave {

namespace autograd {
class Node;
}

class Tensor;
struct TensorImpl;

/// Options for creating tensors: `zeros({2, 3}, {.dtype = kFloat64, .device = "cuda:0"})`.
struct TensorOptions {
  DType dtype = kFloat32;
  Device device = kCPU;
  bool requires_grad = false;
};

/// A gradient hook: receives the gradient, returns a replacement or an undefined Tensor to keep it.
using GradHook = std::function<Tensor(const Tensor&)>;
/// Runs on a leaf after its gradient has been accumulated into `.grad()`.
using PostAccumulateGradHook = std::function<void(Tensor&)>;

/// Removes a registered hook when remove() is called (hooks stay if the handle is dropped).
class HookHandle {
 public:
  HookHandle() = default;
  explicit HookHandle(std::function<void()> remover) : remover_(std::move(remover)) {}
  void remove() {
    if (remover_) {
      auto remover = std::move(remover_);
      remover_ = nullptr;
      remover();
    }
  }

 private:
  std::function<void()> remover_;
};

class Tensor {
 public:
  /// An undefined tensor (no storage); `defined()` is false.
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  bool defined() const { return impl_ != nullptr; }
  TensorImpl* impl() const { return impl_.get(); }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }
  /// True when both handles refer to the same tensor (not just equal values).
  bool is_same(const Tensor& other) const { return impl_ == other.impl_; }

  // ---- metadata -------------------------------------------------------------------------
  const Shape& shape() const;
  const Strides& strides() const;
  /// Size of one dimension; negative dims count from the end.
  int64_t size(int64_t dim) const;
  int dim() const;
  int64_t numel() const;
  int64_t offset() const;
  DType dtype() const;
  Device device() const;
  size_t itemsize() const { return weave::itemsize(dtype()); }
  /// Row-major contiguous (size-1 dimensions may have any stride).
  bool is_contiguous() const;
  const std::shared_ptr<Storage>& storage() const;
  /// Address of the first element (storage base + offset).
  void* data_ptr() const;
  /// Typed address of the first element; raises if T does not match dtype().
  template <class T>
  T* data() const {
    WEAVE_CHECK(dtype_of<T>::value == dtype(), "data", "tensor has dtype {}, requested {}", dtype(),
                dtype_of<T>::value);
    return static_cast<T*>(data_ptr());
  }
  /// Number of in-place modifications of this tensor's storage so far.
  uint64_t version() const;
  /// "tensor([[1, 2], [3, 4]], shape=[2, 2], dtype=float32, device=cpu)".
  std::string str() const;

  // ---- conversion -----------------------------------------------------------------------
  Tensor to(Device device) const;
  Tensor to(DType dtype) const;
  Tensor cpu() const { return to(kCPU); }
  /// A copy with its own storage (differentiable).
  Tensor clone() const;
  /// This tensor if already contiguous, else a contiguous copy (differentiable).
  Tensor contiguous() const;
  /// Shares storage, but is cut from the graph and does not require grad.
  Tensor detach() const;
  /// The single value of a one-element tensor, converted to T.
  template <class T = double>
  T item() const;
  /// All values in row-major order, converted to T.
  template <class T>
  std::vector<T> to_vector() const;

  // ---- autograd -------------------------------------------------------------------------
  /// False for an undefined tensor.
  bool requires_grad() const;
  /// Marks a leaf as requiring grad; returns *this.
  Tensor& requires_grad_(bool enabled = true);
  /// Accumulated gradient of a leaf (or of a tensor that called retain_grad()); may be undefined.
  /// Raises on an undefined tensor.
  Tensor grad() const;
  void set_grad(const Tensor& grad) const;
  /// The node that produced this tensor; null for leaves and undefined tensors.
  const std::shared_ptr<autograd::Node>& grad_fn() const;
  /// Which output of grad_fn this tensor is.
  uint32_t output_nr() const;
  /// True for tensors not produced by a recorded op; raises on an undefined tensor.
  bool is_leaf() const;
  /// Backpropagates from this tensor. grad defaults to 1 for a one-element tensor.
  void backward(const Tensor& grad = {}, bool retain_graph = false) const;
  /// Calls hook with the gradient flowing into this tensor during backward; a defined return
  /// value replaces the gradient.
  HookHandle register_hook(GradHook hook) const;
  /// On a leaf: calls hook after the gradient has been accumulated into grad().
  HookHandle register_post_accumulate_grad_hook(PostAccumulateGradHook hook) const;
  /// Keeps grad() for a non-leaf after backward.
  void retain_grad() const;

  // ---- views (share storage) --------------------------------------------------------------
  Tensor reshape(const Shape& shape) const;
  /// Like reshape, but raises instead of copying when the strides do not allow a view.
  Tensor view(const Shape& shape) const;
  Tensor flatten(int64_t start_dim = 0, int64_t end_dim = -1) const;
  Tensor permute(const Dims& order) const;
  Tensor transpose(int64_t dim0, int64_t dim1) const;
  /// Transpose of a 2-D tensor.
  Tensor t() const;
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const;
  /// Elements start, start+step, ... below end along dim (negative start/end count from the end).
  Tensor slice(int64_t dim, int64_t start, int64_t end, int64_t step = 1) const;
  Tensor select(int64_t dim, int64_t index) const;
  Tensor expand(const Shape& shape) const;
  Tensor squeeze(std::optional<int64_t> dim = std::nullopt) const;
  Tensor unsqueeze(int64_t dim) const;

  // ---- math shortcuts, PyTorch's methods (ops/ops.h has the functions and the rest) -----
  Tensor sum(const Dims& dims = {}, bool keepdim = false) const;
  Tensor mean(const Dims& dims = {}, bool keepdim = false) const;
  Tensor max(const Dims& dims = {}, bool keepdim = false) const;
  Tensor min(const Dims& dims = {}, bool keepdim = false) const;
  /// Variance with Bessel's correction (correction 1) by default.
  Tensor var(const Dims& dims = {}, int64_t correction = 1, bool keepdim = false) const;
  Tensor argmax(std::optional<int64_t> dim = std::nullopt, bool keepdim = false) const;
  Tensor argmin(std::optional<int64_t> dim = std::nullopt, bool keepdim = false) const;
  Tensor matmul(const Tensor& other) const;
  Tensor pow(double exponent) const;
  Tensor neg() const;
  Tensor abs() const;
  Tensor exp() const;
  Tensor log() const;
  Tensor sqrt() const;
  Tensor rsqrt() const;
  Tensor square() const;
  Tensor sin() const;
  Tensor cos() const;
  Tensor tanh() const;
  Tensor sigmoid() const;
  Tensor relu() const;
  Tensor sign() const;
  Tensor clamp(std::optional<double> min, std::optional<double> max = std::nullopt) const;
  /// Softmax along dim.
  Tensor softmax(int64_t dim = -1) const;

  // ---- in-place (bump the version counter) ----------------------------------------------
  Tensor& add_(const Tensor& other, double alpha = 1.0);
  Tensor& add_(double value);
  Tensor& mul_(const Tensor& other);
  Tensor& mul_(double value);
  /// this += value * a * b in one pass (a and b broadcast to this shape; floating dtypes).
  Tensor& addcmul_(const Tensor& a, const Tensor& b, double value = 1.0);
  /// this += value * a / b in one pass.
  Tensor& addcdiv_(const Tensor& a, const Tensor& b, double value = 1.0);
  /// this += weight * (end - this) in one pass.
  Tensor& lerp_(const Tensor& end, double weight);
  /// Copies src (broadcast, converted to this dtype and device) into this tensor.
  Tensor& copy_(const Tensor& src);
  Tensor& fill_(double value);
  Tensor& zero_() { return fill_(0.0); }

 private:
  std::shared_ptr<TensorImpl> impl_;
};

/// Prints t.str().
std::ostream& operator<<(std::ostream& os, const Tensor& t);

/// A new contiguous, uninitialized tensor.
Tensor empty(const Shape& shape, TensorOptions options = {});
/// Bytes that shape elements of dtype occupy; raises an error naming op when a size is negative or
/// the count overflows int64.
int64_t checked_byte_count(const Shape& shape, DType dtype, const char* op);
/// A tensor over the same storage with another shape/strides/offset (no autograd recorded).
Tensor make_view(const Tensor& base, const Shape& shape, const Strides& strides, int64_t offset);
/// A 0-d view (no autograd) of the element at row-major position `index`, whatever the strides.
Tensor element_view(const Tensor& t, int64_t index);

}  // namespace weave

template <>
struct fmt::formatter<weave::Tensor> : fmt::formatter<std::string> {
  auto format(const weave::Tensor& t, fmt::format_context& ctx) const {
    return fmt::formatter<std::string>::format(t.str(), ctx);
  }
};
