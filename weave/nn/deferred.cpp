// Deferred parameters: storages without memory that describe their values, drawn by name.
#include "weave/nn/deferred.h"

#include <atomic>
#include <set>

#include "weave/autograd/grad_mode.h"
#include "weave/nn/init.h"
#include "weave/tensor/tensor_impl.h"

namespace weave::nn {

namespace {

thread_local std::optional<uint64_t> current_seed;
thread_local bool current_for_loading = false;
std::atomic<int64_t> drawn_count{0};

constexpr const char* kDeferredOp = "DeferredInit";
constexpr int64_t kDrawChunk = int64_t(1) << 14;  // elements drawn per host buffer (128 KB)

// Where each element of a tensor sits in the whole tensor its values are drawn for:
// offset + sum(index[d] * strides[d]).
struct WholeMap {
  Shape shape;
  Strides strides;
  int64_t offset = 0;
};

const DeferredValues& values_of(const Tensor& t, const char* op) {
  WEAVE_CHECK(deferred_values(t) != nullptr, op,
              "expected a deferred tensor (built under nn::DeferredInit, not materialized)");
  return *deferred_values(t);
}

// The whole-tensor index of storage element e.
int64_t whole_index_of_storage(const DeferredValues& v, int64_t e) {
  int64_t w = v.offset;
  for (int d = v.shape.size() - 1; d >= 0; --d) {
    const int64_t size = std::max<int64_t>(v.shape[d], 1);
    w += (e % size) * v.strides[d];
    e /= size;
  }
  return w;
}

// t's elements as an affine map into the whole, probed at the origin, one step along each
// dimension and each dimension's far end; a view the probes disagree with is refused.
WholeMap whole_map(const Tensor& t) {
  const DeferredValues& v = values_of(t, kDeferredOp);
  auto at = [&](const Dims& index) {
    int64_t e = t.offset();
    for (int d = 0; d < t.dim(); ++d) e += index[d] * t.strides()[d];
    return whole_index_of_storage(v, e);
  };
  WholeMap map{t.shape(), Strides(std::vector<int64_t>(size_t(t.dim()), 0)), 0};
  Dims index(std::vector<int64_t>(size_t(t.dim()), 0));
  map.offset = at(index);
  for (int d = 0; d < t.dim(); ++d) {
    if (t.size(d) < 2) continue;
    index[d] = 1;
    map.strides[d] = at(index) - map.offset;
    index[d] = t.size(d) - 1;
    WEAVE_CHECK(at(index) == map.offset + index[d] * map.strides[d], kDeferredOp,
                "parameter '{}': a view of shape {} with strides {} does not follow the deferred "
                "values' layout; hint: slice deferred parameters along whole dimensions "
                "(narrow, reshape), or materialize first",
                v.registered_as, t.shape(), t.strides());
    index[d] = 0;
  }
  return map;
}

double draw(const DeferredValues& v, uint64_t key, int64_t whole) {
  if (whole >= v.whole_numel) return 0.0;  // padding
  switch (v.kind) {
    case DeferredValues::Kind::Uniform:
      return v.a + (v.b - v.a) * counter_uniform(key, uint64_t(whole));
    case DeferredValues::Kind::Normal:
      return v.a + v.b * counter_normal(key, uint64_t(whole));
    case DeferredValues::Kind::Constant:
      return v.a;
    case DeferredValues::Kind::Loaded:
      return 0.0;
  }
  return 0.0;
}

Tensor make_deferred(const Shape& shape, DType dtype, Device device,
                     std::shared_ptr<DeferredValues> values) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage =
      Storage::deferred(size_t(shape.numel()) * itemsize(dtype), device, std::move(values));
  impl->shape = shape;
  impl->strides = contiguous_strides(shape);
  impl->dtype = dtype;
  return Tensor(std::move(impl));
}

Tensor fresh_deferred(const Shape& shape, DeferredValues::Kind kind, double a, double b) {
  auto values = std::make_shared<DeferredValues>();
  values->kind = current_for_loading ? DeferredValues::Kind::Loaded : kind;
  values->a = a;
  values->b = b;
  values->seed = *current_seed;
  values->shape = shape;
  values->strides = contiguous_strides(shape);
  values->whole_numel = shape.numel();
  return make_deferred(shape, kFloat32, kCPU, std::move(values));
}

}  // namespace

DeferredInit::DeferredInit(uint64_t seed)
    : outer_(current_seed), outer_for_loading_(current_for_loading) {
  current_seed = seed;
  current_for_loading = false;
}
DeferredInit::DeferredInit(ForLoading) : DeferredInit(0) {
  current_for_loading = true;
}
DeferredInit DeferredInit::for_loading() {
  return DeferredInit(ForLoading{});
}
DeferredInit::~DeferredInit() {
  current_seed = outer_;
  current_for_loading = outer_for_loading_;
}

DeferredValues* deferred_values(const Tensor& t) {
  if (!t.defined() || !t.storage()->deferred_values()) return nullptr;
  // Only this floor makes the records storages carry.
  return static_cast<DeferredValues*>(t.storage()->deferred_values().get());
}

int64_t drawn_elements() {
  return drawn_count.load();
}

std::optional<uint64_t> deferred_init_seed() {
  return current_seed;
}

bool is_deferred(const Tensor& t) {
  return deferred_values(t) != nullptr;
}

std::optional<uint64_t> init_seed(const Tensor& t) {
  if (const DeferredValues* values = deferred_values(t)) return values->seed;
  if (!t.defined() || !t.impl()->autograd) return std::nullopt;
  return t.impl()->autograd->drawn_with_seed;
}

bool has_deferred(const Module& module) {
  for (const auto& [name, p] : module.named_parameters())
    if (is_deferred(p)) return true;
  return false;
}

namespace {

// Elements [first, first + out.numel()) of the tensor that `map` places in the whole, drawn
// into `out` (one dimension, contiguous) from stream `key`.
void draw_range(const DeferredValues& v, const WholeMap& map, uint64_t key, int64_t first,
                const Tensor& out) {
  NoGradGuard no_grad;
  if (v.kind == DeferredValues::Kind::Loaded) {  // a load fills it: nothing to draw
    Tensor(out).zero_();
    return;
  }
  drawn_count += out.numel();
  for (int64_t c0 = 0; c0 < out.numel(); c0 += kDrawChunk) {
    const int64_t count = std::min(kDrawChunk, out.numel() - c0);
    std::vector<double> chunk(static_cast<size_t>(count));
    for (int64_t k = 0; k < count; ++k) {
      int64_t e = first + c0 + k, whole = map.offset;
      for (int d = map.shape.size() - 1; d >= 0; --d) {
        whole += (e % map.shape[d]) * map.strides[d];
        e /= map.shape[d];
      }
      chunk[size_t(k)] = draw(v, key, whole);
    }
    out.narrow(0, c0, count).copy_(from_vector(chunk));
  }
}

// A new deferred tensor holding what view `v` of a deferred tensor holds, in `dtype` on
// `device`.
Tensor copy_of_view(const Tensor& v, DType dtype, Device device) {
  const WholeMap map = whole_map(v);
  auto values = std::make_shared<DeferredValues>(values_of(v, kDeferredOp));
  values->shape = map.shape;
  values->strides = map.strides;
  values->offset = map.offset;
  return make_deferred(v.shape(), dtype, device, std::move(values));
}

}  // namespace

void draw_deferred(const Tensor& t, const std::string& name, int64_t first, const Tensor& out) {
  const DeferredValues& v = values_of(t, "draw_deferred");
  WEAVE_CHECK(
      out.dim() == 1 && out.is_contiguous() && first >= 0 && first + out.numel() <= t.numel(),
      "draw_deferred", "expected a contiguous range of {}'s {} elements, found [{}, {})", name,
      t.numel(), first, first + out.numel());
  draw_range(v, whole_map(t), stream_key(v.seed, name), first, out);
  t.impl()->meta().drawn_with_seed = v.seed;
}

void materialize(Module& module) {
  std::set<const Storage*> done;
  for (auto& [name, p] : module.named_parameters()) {
    if (!is_deferred(p) || !done.insert(p.storage().get()).second) continue;
    WEAVE_CHECK(p.is_contiguous() && p.offset() == 0 &&
                    p.numel() * int64_t(p.itemsize()) == int64_t(p.storage()->nbytes()),
                "materialize",
                "parameter '{}' is a part of a deferred tensor; hint: materialize "
                "the module that holds the whole",
                name);
    // The recipe outlives the storage's hold on it; the values are drawn into the parameter's
    // own memory (no staging copy).
    const std::shared_ptr<DeferredValues> values =
        std::static_pointer_cast<DeferredValues>(p.storage()->deferred_values());
    const WholeMap map = whole_map(p);
    p.storage()->clear_deferred();
    p.storage()->allocate_again();
    draw_range(*values, map, stream_key(values->seed, name), 0, p.detach().reshape({p.numel()}));
    p.impl()->meta().drawn_with_seed = values->seed;
  }
}

void materialize_for_overwrite(const Tensor& t) {
  if (t.defined() && t.impl()->autograd) t.impl()->meta().drawn_with_seed.reset();
  if (!is_deferred(t)) return;
  t.storage()->clear_deferred();
  t.storage()->allocate_again();
  NoGradGuard no_grad;
  t.detach().zero_();  // what no write reaches (a padded vocabulary's rows) holds zeros
}

Tensor deferred_copy(const Tensor& v) {
  return copy_of_view(v, v.dtype(), v.device());
}

Tensor deferred_pad_rows(const Tensor& whole, int64_t rows) {
  WEAVE_CHECK(whole.dim() >= 1 && rows >= whole.size(0), "deferred_pad_rows",
              "{} rows cannot be padded to {}", whole.dim() ? whole.size(0) : 0, rows);
  const WholeMap map = whole_map(whole);
  auto values = std::make_shared<DeferredValues>(values_of(whole, "deferred_pad_rows"));
  Shape shape = whole.shape();
  shape[0] = rows;
  values->shape = shape;
  values->strides = map.strides;
  values->offset = map.offset;
  if (whole.size(0) == 1) values->strides[0] = whole.numel();  // a probe saw no second row
  return make_deferred(shape, whole.dtype(), whole.device(), std::move(values));
}

Tensor deferred_to(const Tensor& t, DType dtype, Device device) {
  return copy_of_view(t, dtype, device);
}

namespace init {

Tensor uniform_parameter(const Shape& shape, double low, double high, Generator* generator) {
  check_uniform_range(low, high);
  if (current_seed) return fresh_deferred(shape, DeferredValues::Kind::Uniform, low, high);
  Tensor t = empty(shape);
  uniform_(t, low, high, generator);
  return t;
}

Tensor normal_parameter(const Shape& shape, double mean, double std, Generator* generator) {
  check_normal_spread(mean, std);
  if (current_seed) return fresh_deferred(shape, DeferredValues::Kind::Normal, mean, std);
  Tensor t = empty(shape);
  normal_(t, mean, std, generator);
  return t;
}

Tensor constant_parameter(const Shape& shape, double value) {
  if (current_seed) return fresh_deferred(shape, DeferredValues::Kind::Constant, value, 0);
  return full(shape, value);
}

bool set_deferred_recipe(const Tensor& t, DeferredValues::Kind kind, double a, double b) {
  if (!is_deferred(t)) return false;
  DeferredValues& v = *deferred_values(t);
  if (v.kind == DeferredValues::Kind::Loaded) return true;  // a load fills it
  v.kind = kind;
  v.a = a;
  v.b = b;
  return true;
}

}  // namespace init

}  // namespace weave::nn
