#include "weave/tensor/tensor.h"

#include <charconv>
#include <mutex>

#include "weave/tensor/random.h"
#include "weave/tensor/tensor_impl.h"

namespace weave {

namespace {
std::mutex last_error_mutex;
std::string last_error;
}  // namespace

std::string last_error_message() {
  std::lock_guard lock(last_error_mutex);
  return last_error;
}

namespace detail {
void throw_error(std::string message) {
  {
    std::lock_guard lock(last_error_mutex);
    last_error = message;
  }
  throw Error(std::move(message));
}
void fail_call(const char* op, const char* call, const std::string& error) {
  throw_error(fmt::format("[{}] {} failed: {}", op, call, error));
}
}  // namespace detail

// ---- dtype ------------------------------------------------------------------------------

size_t itemsize(DType dtype) {
  return visit_dtype(dtype, [](auto tag) { return sizeof(typename decltype(tag)::type); });
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case kFloat32:
      return "float32";
    case kFloat64:
      return "float64";
    case kBFloat16:
      return "bfloat16";
    case kFloat16:
      return "float16";
    case kInt32:
      return "int32";
    case kInt64:
      return "int64";
    case kUInt8:
      return "uint8";
    case kBool:
      return "bool";
  }
  return "unknown";
}

bool is_floating(DType d) {
  return d == kFloat32 || d == kFloat64 || d == kBFloat16 || d == kFloat16;
}
bool is_integral(DType d) {
  return d == kInt32 || d == kInt64 || d == kUInt8;
}

DType promote_types(DType a, DType b) {
  if (a == b) return a;
  auto category = [](DType d) { return d == kBool ? 0 : is_integral(d) ? 1 : 2; };
  if (category(a) != category(b)) return category(a) > category(b) ? a : b;
  if (category(a) == 1) {
    auto rank = [](DType d) { return d == kUInt8 ? 0 : d == kInt32 ? 1 : 2; };
    return rank(a) > rank(b) ? a : b;
  }
  if (a == kFloat64 || b == kFloat64) return kFloat64;
  return kFloat32;  // float32 with a 16-bit format, or float16 with bfloat16
}

// ---- device -----------------------------------------------------------------------------

Device::Device(std::string_view spec) {
  if (spec == "cpu") return;
  if (spec.starts_with("cuda")) {
    type = DeviceType::CUDA;
    if (spec.size() == 4) return;
    auto digits = spec.substr(5);
    auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), index);
    if (spec[4] == ':' && ec == std::errc() && end == digits.data() + digits.size() && index >= 0)
      return;
  }
  WEAVE_FAIL("device", "cannot parse device '{}'; expected 'cpu', 'cuda' or 'cuda:N'", spec);
}

std::string Device::str() const {
  return is_cpu() ? "cpu" : fmt::format("cuda:{}", index);
}

// ---- shapes -----------------------------------------------------------------------------

std::string Dims::str() const {
  return fmt::format("[{}]", fmt::join(begin(), end(), ", "));
}

Strides contiguous_strides(const Shape& shape) {
  Strides strides = Dims::filled(shape.size(), 1);
  for (int i = shape.size() - 2; i >= 0; --i)
    // Only a shape with a zero size can overflow here (any other was rejected with its element
    // count); it addresses no memory, so a saturated stride is as good as any.
    if (__builtin_mul_overflow(strides[i + 1], std::max<int64_t>(shape[i + 1], 1), &strides[i]))
      strides[i] = INT64_MAX;
  return strides;
}

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  int rank = std::max(a.size(), b.size());
  Shape out = Dims::filled(rank, 1);
  for (int i = 0; i < rank; ++i) {
    int ia = i - (rank - a.size()), ib = i - (rank - b.size());
    int64_t da = ia >= 0 ? a[ia] : 1, db = ib >= 0 ? b[ib] : 1;
    WEAVE_CHECK(da == db || da == 1 || db == 1, op,
                "shapes {} and {} cannot be broadcast: dimension {} is {} vs {}", a, b, i, da, db);
    out[i] = da == 1 ? db : da;
  }
  return out;
}

int normalize_dim(int64_t dim, int rank, const char* op) {
  int64_t bound = std::max(rank, 1);  // a scalar accepts dim 0 and -1
  WEAVE_CHECK(dim >= -bound && dim < bound, op,
              "dimension {} out of range for a tensor of rank {}; expected [{}, {}]", dim, rank,
              -bound, bound - 1);
  return static_cast<int>(dim < 0 ? dim + bound : dim);
}

// ---- random -----------------------------------------------------------------------------

Generator& default_generator() {
  static Generator generator;
  return generator;
}
void manual_seed(uint64_t seed) {
  default_generator().seed(seed);
}

// ---- tensor metadata --------------------------------------------------------------------

namespace {
const TensorImpl& checked(const std::shared_ptr<TensorImpl>& impl) {
  WEAVE_CHECK(impl != nullptr, "tensor", "operation on an undefined tensor; hint: create it first");
  return *impl;
}
}  // namespace

const Shape& Tensor::shape() const {
  return checked(impl_).shape;
}
const Strides& Tensor::strides() const {
  return checked(impl_).strides;
}
int64_t Tensor::size(int64_t dim) const {
  WEAVE_CHECK(this->dim() > 0, "size",
              "a 0-d tensor has no dimension {}; hint: numel() counts its one element", dim);
  return shape()[normalize_dim(dim, this->dim(), "size")];
}
int Tensor::dim() const {
  return shape().size();
}
int64_t Tensor::numel() const {
  return shape().numel();
}
int64_t Tensor::offset() const {
  return checked(impl_).offset;
}
DType Tensor::dtype() const {
  return checked(impl_).dtype;
}
Device Tensor::device() const {
  return checked(impl_).storage->device();
}
const std::shared_ptr<Storage>& Tensor::storage() const {
  return checked(impl_).storage;
}
uint64_t Tensor::version() const {
  return storage()->version();
}

void* Tensor::data_ptr() const {
  const TensorImpl& t = checked(impl_);
  if (const auto& deferred = t.storage->deferred_values())
    WEAVE_FAIL("data",
               "parameter '{}' was built under nn::DeferredInit and holds no values yet; hint: "
               "nn::materialize(model) draws them, or hand the model to "
               "FullyShardedDataParallel, which draws only this rank's shards",
               deferred->parameter_name());
  WEAVE_CHECK(!t.storage->released(), "data",
              "the tensor's memory was released (a fully sharded parameter outside its unit's "
              "forward and backward); hint: give checkpoints fsdp.sharded_module() (this "
              "rank's shards), and read whole parameters through fsdp.full_state_dict()");
  return static_cast<char*>(t.storage->data()) + t.offset * weave::itemsize(t.dtype);
}

bool Tensor::is_contiguous() const {
  const TensorImpl& t = checked(impl_);
  int64_t expected = 1;
  for (int i = t.shape.size() - 1; i >= 0; --i) {
    if (t.shape[i] == 1) continue;
    if (t.strides[i] != expected) return false;
    expected *= t.shape[i];
  }
  return true;
}

int64_t checked_byte_count(const Shape& shape, DType dtype, const char* op) {
  for (int64_t d : shape) WEAVE_CHECK(d >= 0, op, "sizes must be non-negative, found {}", shape);
  int64_t bytes = int64_t(weave::itemsize(dtype));
  for (int64_t d : shape)
    WEAVE_CHECK(!__builtin_mul_overflow(bytes, d, &bytes), op,
                "{} elements of {} do not fit in memory (the byte count overflows int64)", shape,
                dtype);
  return bytes;
}

Tensor empty(const Shape& shape, TensorOptions options) {
  const int64_t bytes = checked_byte_count(shape, options.dtype, "empty");
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::make_shared<Storage>(size_t(bytes), options.device);
  impl->shape = shape;
  impl->strides = contiguous_strides(shape);
  impl->dtype = options.dtype;
  Tensor t(std::move(impl));
  if (options.requires_grad) t.requires_grad_(true);
  return t;
}

Tensor make_view(const Tensor& base, const Shape& shape, const Strides& strides, int64_t offset) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = base.storage();
  impl->shape = shape;
  impl->strides = strides;
  impl->offset = offset;
  impl->dtype = base.dtype();
  impl->view_base = base.impl()->view_base ? base.impl()->view_base : base.impl_ptr();
  return Tensor(std::move(impl));
}

Tensor element_view(const Tensor& t, int64_t index) {
  WEAVE_CHECK(index >= 0 && index < t.numel(), "element_view",
              "index {} is outside a tensor of {} elements", index, t.numel());
  int64_t offset = t.offset();
  for (int d = t.dim() - 1; d >= 0; --d) {
    offset += (index % t.shape()[d]) * t.strides()[d];
    index /= t.shape()[d];
  }
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = t.storage();
  impl->offset = offset;
  impl->dtype = t.dtype();
  return Tensor(std::move(impl));
}

}  // namespace weave
