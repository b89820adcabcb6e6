// Creation, conversion, in-place ops and the Tensor method shortcuts (printing: printing.cpp).
#include <omp.h>
#include <cmath>
#include <functional>
#include <thread>
#include "weave/kernels/cpu/eigen.h"

#include "weave/autograd/grad_mode.h"
#include "weave/ops/internal.h"
#include "weave/tensor/tensor_impl.h"

namespace weave {

using namespace detail;

// ---- creation ---------------------------------------------------------------------------

Tensor full(const Shape& shape, double value, TensorOptions options) {
  Tensor t = empty(shape, {.dtype = options.dtype, .device = options.device});
  kernels::fill(t, value);
  if (options.requires_grad) t.requires_grad_(true);
  return t;
}
Tensor zeros(const Shape& shape, TensorOptions options) {
  return full(shape, 0.0, options);
}
Tensor ones(const Shape& shape, TensorOptions options) {
  return full(shape, 1.0, options);
}
Tensor full_like(const Tensor& t, double value) {
  return full(t.shape(), value, {.dtype = t.dtype(), .device = t.device()});
}
Tensor zeros_like(const Tensor& t) {
  return full_like(t, 0.0);
}
Tensor ones_like(const Tensor& t) {
  return full_like(t, 1.0);
}
Tensor scalar_tensor(double value, TensorOptions options) {
  return full({}, value, options);
}

namespace {
// Fills a host tensor element by element from `next`, then moves it to the target device.
template <class Next>
Tensor generate(const Shape& shape, TensorOptions options, Next next) {
  Tensor host = empty(shape, {.dtype = options.dtype});
  visit_dtype(options.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* p = static_cast<T*>(host.data_ptr());
    for (int64_t i = 0; i < host.numel(); ++i) p[i] = T(static_cast<compute_t<T>>(next(i)));
  });
  Tensor t = options.device.is_cpu() ? host : host.to(options.device);
  if (options.requires_grad) t.requires_grad_(true);
  return t;
}
}  // namespace

Tensor arange(double start, double end, double step, TensorOptions options) {
  WEAVE_CHECK(step != 0 && std::isfinite(start) && std::isfinite(end), "arange",
              "expected finite bounds and a non-zero step, found ({}, {}, {})", start, end, step);
  const double count = std::ceil((end - start) / step);
  // 2^53 is where doubles stop counting every integer; beyond it the values themselves repeat.
  WEAVE_CHECK(count <= 9007199254740992.0, "arange",
              "[{}, {}) in steps of {} holds {:g} values, more than can be counted exactly; hint: "
              "check the bounds",
              start, end, step, count);
  const int64_t n = std::max<int64_t>(0, static_cast<int64_t>(count));
  return generate({n}, options, [&](int64_t i) { return start + static_cast<double>(i) * step; });
}
Tensor arange(double end, TensorOptions options) {
  return arange(0, end, 1, options);
}

Tensor eye(int64_t n, int64_t m, TensorOptions options) {
  if (m < 0) m = n;
  WEAVE_CHECK(n >= 0, "eye", "size must be non-negative, found {}", n);
  return generate({n, m}, options, [m](int64_t i) { return i / m == i % m ? 1.0 : 0.0; });
}

Tensor rand(const Shape& shape, TensorOptions options, Generator* generator) {
  WEAVE_CHECK(is_floating(options.dtype), "rand", "expected a floating dtype, found {}",
              options.dtype);
  Generator& g = generator ? *generator : default_generator();
  return generate(shape, options, [&](int64_t) { return g.uniform(); });
}

Tensor randn(const Shape& shape, TensorOptions options, Generator* generator) {
  WEAVE_CHECK(is_floating(options.dtype), "randn", "expected a floating dtype, found {}",
              options.dtype);
  Generator& g = generator ? *generator : default_generator();
  return generate(shape, options, [&](int64_t) { return g.normal(); });
}

Tensor randint(int64_t low, int64_t high, const Shape& shape, TensorOptions options,
               Generator* generator) {
  WEAVE_CHECK(low < high, "randint", "expected low < high, found [{}, {})", low, high);
  Generator& g = generator ? *generator : default_generator();
  return generate(shape, options,
                  [&](int64_t) { return static_cast<double>(g.integer(low, high)); });
}

template <class T>
Tensor from_vector(const std::vector<T>& values, const Shape& shape, Device device) {
  const int64_t count = static_cast<int64_t>(values.size());
  Shape s = shape.empty() ? Shape{count} : shape;
  WEAVE_CHECK(s.numel() == count, "from_vector", "{} values do not fill shape {}", count, s);
  Tensor host = empty(s, {.dtype = dtype_of<T>::value});
  std::copy(values.begin(), values.end(), static_cast<T*>(host.data_ptr()));
  return device.is_cpu() ? host : host.to(device);
}
template Tensor from_vector(const std::vector<float>&, const Shape&, Device);
template Tensor from_vector(const std::vector<double>&, const Shape&, Device);
template Tensor from_vector(const std::vector<int32_t>&, const Shape&, Device);
template Tensor from_vector(const std::vector<int64_t>&, const Shape&, Device);
template Tensor from_vector(const std::vector<uint8_t>&, const Shape&, Device);

template <>
Tensor from_vector(const std::vector<bool>& values, const Shape& shape, Device device) {
  std::vector<uint8_t> bytes(values.begin(), values.end());
  Tensor t = from_vector(bytes, shape, kCPU);
  Tensor b = empty(t.shape(), {.dtype = kBool});
  kernels::copy(t, b);
  return device.is_cpu() ? b : b.to(device);
}

Tensor from_blob(void* data, const Shape& shape, DType dtype, Device device,
                 std::function<void(void*)> deleter) {
  const int64_t bytes = checked_byte_count(shape, dtype, "from_blob");
  WEAVE_CHECK(data != nullptr || bytes == 0, "from_blob",
              "expected memory behind {} elements, found a null pointer", shape);
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::make_shared<Storage>(data, size_t(bytes), device, std::move(deleter));
  impl->shape = shape;
  impl->strides = contiguous_strides(shape);
  impl->dtype = dtype;
  return Tensor(std::move(impl));
}

// ---- conversion -------------------------------------------------------------------------

Tensor Tensor::to(DType dtype) const {
  if (this->dtype() == dtype) return *this;
  Tensor out = convert(*this, dtype);
  if (!is_floating(dtype)) return out;  // integer results carry no gradient
  // d to(dtype) = g converted back
  return autograd::record("ToBackward", {*this}, out, [&] {
    return [from = this->dtype()](const BackwardArgs& args) -> Grads {
      return {convert(args.grad(), from)};
    };
  });
}

Tensor Tensor::to(Device device) const {
  if (this->device() == device) return *this;
  Tensor out = empty(shape(), {.dtype = dtype(), .device = device});
  kernels::copy(*this, out);
  // d to(device) = g moved back
  return autograd::record("ToDeviceBackward", {*this}, out, [&] {
    return [from = this->device()](const BackwardArgs& args) -> Grads {
      return {args.grad().to(from)};
    };
  });
}

Tensor Tensor::clone() const {
  Tensor out = empty(shape(), {.dtype = dtype(), .device = device()});
  kernels::copy(*this, out);
  // d clone = g
  return autograd::record("CloneBackward", {*this}, out, [&] {
    return [](const BackwardArgs& args) -> Grads { return {args.grad()}; };
  });
}

Tensor Tensor::contiguous() const {
  return is_contiguous() ? *this : clone();
}

Tensor Tensor::detach() const {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = storage();
  impl->shape = shape();
  impl->strides = strides();
  impl->offset = offset();
  impl->dtype = dtype();
  return Tensor(std::move(impl));
}

template <class T>
std::vector<T> Tensor::to_vector() const {
  Tensor host = empty(shape(), {.dtype = dtype()});
  kernels::copy(*this, host);
  std::vector<T> values(host.numel());
  visit_dtype(dtype(), [&](auto tag) {
    using S = typename decltype(tag)::type;
    const S* p = static_cast<const S*>(host.data_ptr());
    for (size_t i = 0; i < values.size(); ++i)
      values[i] = static_cast<T>(static_cast<compute_t<S>>(p[i]));
  });
  return values;
}

template <class T>
T Tensor::item() const {
  WEAVE_CHECK(numel() == 1, "item", "expected a one-element tensor, found shape {}", shape());
  return to_vector<T>()[0];
}

#define WEAVE_INSTANTIATE(T)                            \
  template std::vector<T> Tensor::to_vector<T>() const; \
  template T Tensor::item<T>() const;
WEAVE_INSTANTIATE(float)
WEAVE_INSTANTIATE(double)
WEAVE_INSTANTIATE(int32_t)
WEAVE_INSTANTIATE(int64_t)
WEAVE_INSTANTIATE(uint8_t)
WEAVE_INSTANTIATE(bool)
#undef WEAVE_INSTANTIATE

// ---- in-place ---------------------------------------------------------------------------

namespace detail {

bool inplace_needs_autograd(const Tensor& self, const Tensor& other, const char* op) {
  check_defined(self, op);
  if (!autograd::GradMode::is_enabled()) return false;
  const bool other_grad = other.defined() && other.requires_grad();
  if (!self.requires_grad() && !other_grad) return false;
  WEAVE_CHECK(!(self.is_leaf() && self.requires_grad()), op,
              "a leaf tensor of shape {} that requires grad cannot be modified in place while grad "
              "mode is on; hint: update it inside NoGradGuard (as optimizers do)",
              self.shape());
  WEAVE_CHECK(self.impl()->view_base == nullptr, op,
              "autograd does not support in-place ops on views (shape {}); hint: use the "
              "out-of-place op",
              self.shape());
  return true;
}

void commit_inplace(Tensor& self, const Tensor& result) {
  Tensor converted = result.to(self.dtype());
  kernels::copy(converted, self);
  self.storage()->bump_version();
  AutogradMeta& meta = self.impl()->meta();
  meta.grad_fn = converted.grad_fn();
  meta.output_nr = converted.output_nr();
  meta.requires_grad = converted.requires_grad();
}

}  // namespace detail

namespace {

void check_writable(const Tensor& self, const Tensor& other, const char* op) {
  for (int d = 0; d < self.dim(); ++d)
    WEAVE_CHECK(self.strides()[d] != 0 || self.shape()[d] <= 1, op,
                "the written tensor (shape {}) is a broadcast view whose elements share memory; "
                "hint: clone() it first",
                self.shape());
  if (other.defined()) {
    check_same_device(self, other, op);
    WEAVE_CHECK(broadcast_shapes(self.shape(), other.shape(), op) == self.shape(), op,
                "cannot broadcast {} into the written tensor of shape {}", other.shape(),
                self.shape());
  }
}

Tensor& binary_inplace(Tensor& self, const Tensor& other, kernels::BinaryOp op, const char* name,
                       Tensor (*out_of_place)(const Tensor&, const Tensor&)) {
  check_defined(other, name, "other");
  check_writable(self, other, name);
  // PyTorch's rule: the result may narrow within its kind, never lose a kind (a fraction
  // truncated into an integer, a number squeezed into a bool).
  const bool loses_kind = (is_floating(other.dtype()) && !is_floating(self.dtype())) ||
                          (self.dtype() == kBool && other.dtype() != kBool);
  WEAVE_CHECK(!loses_kind, name,
              "the result is {}, which cannot be written into the {} tensor without losing "
              "values; hint: use the out-of-place op, or convert with .to() first",
              other.dtype(), self.dtype());
  if (inplace_needs_autograd(self, other, name)) {
    commit_inplace(self, out_of_place(self.clone(), other));
    return self;
  }
  kernels::binary(op, self, broadcast_view(convert(other, self.dtype()), self.shape()), self);
  self.storage()->bump_version();
  return self;
}

}  // namespace

Tensor& Tensor::add_(const Tensor& other, double alpha) {
  return binary_inplace(*this, alpha == 1.0 ? other : other * alpha, kernels::BinaryOp::Add, "add_",
                        weave::add);
}
Tensor& Tensor::add_(double value) {
  return add_(wrap_scalar(value, *this));
}
Tensor& Tensor::mul_(const Tensor& other) {
  return binary_inplace(*this, other, kernels::BinaryOp::Mul, "mul_", weave::mul);
}
Tensor& Tensor::mul_(double value) {
  return mul_(wrap_scalar(value, *this));
}

namespace {

// The fused in-place updates share their checks and their autograd fallback (the same
// expression out of place, committed into self).
Tensor& fused_inplace(Tensor& self, const std::vector<Tensor>& operands, const char* name,
                      const std::function<Tensor(const Tensor&)>& out_of_place,
                      const std::function<void(const std::vector<Tensor>&)>& kernel) {
  WEAVE_CHECK(self.defined(), name, "called on an undefined tensor");
  WEAVE_CHECK(is_floating(self.dtype()), name,
              "expected a floating tensor, found {}; hint: .to(kFloat32) first", self.dtype());
  for (const Tensor& t : operands) {
    check_defined(t, name, "operand");
    check_writable(self, t, name);
  }
  bool needs_graph = false;
  for (const Tensor& t : operands)
    needs_graph = needs_graph || inplace_needs_autograd(self, t, name);
  if (needs_graph) {
    commit_inplace(self, out_of_place(self.clone()));
    return self;
  }
  std::vector<Tensor> views;
  for (const Tensor& t : operands)
    views.push_back(broadcast_view(convert(t, self.dtype()), self.shape()));
  kernel(views);
  self.storage()->bump_version();
  return self;
}

}  // namespace

Tensor& Tensor::addcmul_(const Tensor& a, const Tensor& b, double value) {
  return fused_inplace(
      *this, {a, b}, "addcmul_", [&](const Tensor& s) { return s + a * b * value; },
      [&](const std::vector<Tensor>& v) {
        kernels::addcmul(*this, v[0], v[1], value, false, *this);
      });
}
Tensor& Tensor::addcdiv_(const Tensor& a, const Tensor& b, double value) {
  return fused_inplace(
      *this, {a, b}, "addcdiv_", [&](const Tensor& s) { return s + a / b * value; },
      [&](const std::vector<Tensor>& v) {
        kernels::addcmul(*this, v[0], v[1], value, true, *this);
      });
}
Tensor& Tensor::lerp_(const Tensor& end, double weight) {
  return fused_inplace(
      *this, {end}, "lerp_", [&](const Tensor& s) { return s + (end - s) * weight; },
      [&](const std::vector<Tensor>& v) { kernels::lerp(*this, v[0], weight, *this); });
}

Tensor& Tensor::copy_(const Tensor& src) {
  check_defined(src, "copy_", "src");
  Tensor moved = src.device() == device() ? src : src.to(device());
  check_writable(*this, moved, "copy_");
  if (inplace_needs_autograd(*this, moved, "copy_")) {
    commit_inplace(*this, weave::expand(moved.to(dtype()), shape()));
    return *this;
  }
  kernels::copy(broadcast_view(moved, shape()), *this);
  storage()->bump_version();
  return *this;
}

Tensor& Tensor::fill_(double value) {
  check_writable(*this, {}, "fill_");
  if (inplace_needs_autograd(*this, {}, "fill_")) {
    // The old values no longer matter: the node passes no gradient back.
    Tensor filled = full_like(*this, value);
    commit_inplace(*this, autograd::record("FillBackward", {*this}, filled, [&] {
      return [](const BackwardArgs&) -> Grads { return {Tensor()}; };
    }));
    return *this;
  }
  kernels::fill(*this, value);
  storage()->bump_version();
  return *this;
}

// ---- method shortcuts -------------------------------------------------------------------

Tensor Tensor::reshape(const Shape& s) const {
  return weave::reshape(*this, s);
}
Tensor Tensor::view(const Shape& s) const {
  return weave::view(*this, s);
}
Tensor Tensor::flatten(int64_t a, int64_t b) const {
  return weave::flatten(*this, a, b);
}
Tensor Tensor::permute(const Dims& order) const {
  return weave::permute(*this, order);
}
Tensor Tensor::transpose(int64_t a, int64_t b) const {
  return weave::transpose(*this, a, b);
}
Tensor Tensor::t() const {
  WEAVE_CHECK(dim() <= 2, "t", "expected a tensor with at most 2 dims, found {}", shape());
  return dim() < 2 ? *this : weave::transpose(*this, 0, 1);
}
Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length) const {
  return weave::narrow(*this, d, start, length);
}
Tensor Tensor::slice(int64_t d, int64_t start, int64_t end, int64_t step) const {
  return weave::slice(*this, d, start, end, step);
}
Tensor Tensor::select(int64_t d, int64_t index) const {
  return weave::select(*this, d, index);
}
Tensor Tensor::expand(const Shape& s) const {
  return weave::expand(*this, s);
}
Tensor Tensor::squeeze(std::optional<int64_t> d) const {
  return weave::squeeze(*this, d);
}
Tensor Tensor::unsqueeze(int64_t d) const {
  return weave::unsqueeze(*this, d);
}
Tensor Tensor::sum(const Dims& dims, bool keepdim) const {
  return weave::sum(*this, dims, keepdim);
}
Tensor Tensor::mean(const Dims& dims, bool keepdim) const {
  return weave::mean(*this, dims, keepdim);
}
Tensor Tensor::max(const Dims& dims, bool keepdim) const {
  return weave::max(*this, dims, keepdim);
}
Tensor Tensor::min(const Dims& dims, bool keepdim) const {
  return weave::min(*this, dims, keepdim);
}
Tensor Tensor::argmax(std::optional<int64_t> d, bool keepdim) const {
  return weave::argmax(*this, d, keepdim);
}
Tensor Tensor::matmul(const Tensor& other) const {
  return weave::matmul(*this, other);
}
Tensor Tensor::pow(double exponent) const {
  return weave::pow(*this, exponent);
}
Tensor Tensor::argmin(std::optional<int64_t> d, bool keepdim) const {
  return weave::argmin(*this, d, keepdim);
}
Tensor Tensor::var(const Dims& dims, int64_t correction, bool keepdim) const {
  return weave::var(*this, dims, correction, keepdim);
}
Tensor Tensor::clamp(std::optional<double> lo, std::optional<double> hi) const {
  return weave::clamp(*this, lo, hi);
}
Tensor Tensor::softmax(int64_t dim) const {
  return weave::softmax(*this, dim);
}

// The unary shortcuts: each calls the op of its name.
#define WEAVE_UNARY_METHOD(op) \
  Tensor Tensor::op() const {  \
    return weave::op(*this);   \
  }
WEAVE_UNARY_METHOD(neg)
WEAVE_UNARY_METHOD(abs)
WEAVE_UNARY_METHOD(exp)
WEAVE_UNARY_METHOD(log)
WEAVE_UNARY_METHOD(sqrt)
WEAVE_UNARY_METHOD(rsqrt)
WEAVE_UNARY_METHOD(square)
WEAVE_UNARY_METHOD(sin)
WEAVE_UNARY_METHOD(cos)
WEAVE_UNARY_METHOD(tanh)
WEAVE_UNARY_METHOD(sigmoid)
WEAVE_UNARY_METHOD(relu)
WEAVE_UNARY_METHOD(sign)
#undef WEAVE_UNARY_METHOD

// ---- threads ----------------------------------------------------------------------------

void set_num_threads(int threads) {
  // OpenMP's team start crashes long before this many threads; a few per core is the useful most.
  const int most = std::max(1024, 4 * int(std::thread::hardware_concurrency()));
  WEAVE_CHECK(threads >= 1 && threads <= most, "set_num_threads",
              "expected 1 to {} threads, found {}; hint: one thread per core ({} here)", most,
              threads, std::thread::hardware_concurrency());
  omp_set_num_threads(threads);
  Eigen::setNbThreads(threads);
  kernels::set_max_threads(threads);
}
void set_float32_matmul_precision(const std::string& precision) {
  WEAVE_CHECK(precision == "highest" || precision == "high" || precision == "medium",
              "set_float32_matmul_precision",
              "expected \"highest\", \"high\" or \"medium\", found \"{}\"", precision);
  kernels::set_float32_matmul_precision(precision == "highest"
                                            ? kernels::Float32MatmulPrecision::Highest
                                            : kernels::Float32MatmulPrecision::High);
}

std::string float32_matmul_precision() {
  return kernels::float32_matmul_precision() == kernels::Float32MatmulPrecision::Highest ? "highest"
                                                                                         : "high";
}

int num_threads() {
  return kernels::max_threads();
}

}  // namespace weave
