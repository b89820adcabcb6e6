#pragma once
// Deferred initialization: a model built without memory, whose parameters are drawn later, by
// name, only where they are needed. A model larger than one rank is built this way and handed
// to FullyShardedDataParallel, which draws each rank's shards and nothing else:
//
//   std::shared_ptr<models::Llama> model;
//   {
//     nn::DeferredInit deferred(/*seed=*/1234);   // this thread's modules allocate nothing
//     model = std::make_shared<models::Llama>(options);
//   }
//   parallel::FullyShardedDataParallel fsdp(*model);  // draws this rank's shards
//   // or, on one process:  nn::materialize(*model);
//
// Values are drawn by the counter-based generator (random.h) keyed by the seed and the
// parameter's name, with the element's index in the whole tensor as the counter: a
// tensor-parallel slice, an FSDP flat range or a pipeline stage's blocks hold, bit for bit, what
// one process materializing the whole model holds, whatever the layout. A model built outside a
// scope draws from the sequential generator at construction, as before (other values).
//
// Until then a deferred parameter has its name, shape, dtype, device and placement, and its
// recipe (init::uniform_, normal_, zeros_ and ones_ on it replace the recipe: a model's own
// initialization runs unchanged); reading it raises, naming it. Module::to changes its dtype
// and device without allocating.
#include <cstdint>
#include <optional>
#include <string>

#include "weave/nn/module.h"

namespace weave::nn {

/// The values a storage built under DeferredInit will hold once materialized (the record the
/// tensor floor carries): a distribution, and where each of the storage's elements sits in the
/// whole tensor they are drawn for. Element e of the storage (row-major over `shape`) is element
/// offset + sum(index[d] * strides[d]) of the whole; one at or past whole_numel is padding (0).
struct DeferredValues : DeferredRecord {
  /// Loaded: no values of its own (a load fills it): zeros where allocated, nothing drawn.
  enum class Kind { Uniform, Normal, Constant, Loaded };
  Kind kind = Kind::Constant;
  double a = 0, b = 0;  // Uniform [a, b); Normal mean a, std b; Constant a
  uint64_t seed = 0;
  std::string registered_as;  // the name its module gave it, for errors ("" until registered)
  Shape shape;
  Strides strides;
  int64_t offset = 0;
  int64_t whole_numel = 0;
  const std::string& parameter_name() const override { return registered_as; }
};
/// Deferred `t`'s values (null when `t` is not deferred).
DeferredValues* deferred_values(const Tensor& t);

/// While it lives, parameters created on this thread (by nn layers, the parallel layers and
/// the library's models) are deferred, drawn with `seed` when materialized. Scopes nest.
class DeferredInit {
 public:
  explicit DeferredInit(uint64_t seed = 0);
  /// A scope for a model whose every parameter a load will fill (models::from_pretrained,
  /// parallel::load_pretrained): its parameters, and FSDP's shards of them, are allocated as
  /// zeros where needed and never drawn; initialization recipes set on them are ignored.
  ///   auto scope = nn::DeferredInit::for_loading();
  static DeferredInit for_loading();
  ~DeferredInit();
  DeferredInit(const DeferredInit&) = delete;
  DeferredInit& operator=(const DeferredInit&) = delete;

 private:
  struct ForLoading {};
  explicit DeferredInit(ForLoading);
  std::optional<uint64_t> outer_;
  bool outer_for_loading_ = false;
};

/// How many elements this process has drawn from deferred recipes (materialize, FSDP's shards)
/// since it started: what a test of a load that must draw nothing counts.
int64_t drawn_elements();

/// The seed of the innermost DeferredInit on this thread; none outside every scope.
std::optional<uint64_t> deferred_init_seed();
/// Whether `t` is deferred (built under DeferredInit and not materialized yet).
bool is_deferred(const Tensor& t);
/// Whether any parameter of `module` is deferred.
bool has_deferred(const Module& module);

/// Allocates and draws every deferred parameter of `module`, by its name in `module`; others are
/// left as they are. The values equal those of every layout of the same model built with the
/// same seed.
void materialize(Module& module);

/// Readies `t` for values about to be written over it (load_state_dict, load_pretrained): a
/// deferred one's memory is allocated, zeroed, without drawing it, and any tensor forgets the
/// seed it was drawn with (init_seed: its values are the file's now).
void materialize_for_overwrite(const Tensor& t);

/// The DeferredInit seed `t`'s values are (deferred) or were (materialized, drawn into shards)
/// drawn with; none for values drawn eagerly or loaded. What the ranks building one model
/// agree on (parallel::materialize, the data-parallel wrappers, pipelines).
std::optional<uint64_t> init_seed(const Tensor& t);

/// Writes elements [first, first + out.numel()) of deferred `t` (row-major) into `out` (one
/// dimension, contiguous, any dtype and device), drawn for the parameter named `name`: what
/// a fully sharded wrapper fills its shards with.
void draw_deferred(const Tensor& t, const std::string& name, int64_t first, const Tensor& out);

/// A deferred tensor holding what view `v` of a deferred tensor holds (narrow, reshape, detach):
/// a tensor-parallel slice drawn without its whole. Raises for a view it cannot follow.
Tensor deferred_copy(const Tensor& v);
/// Deferred `whole` extended with zero rows to `rows` rows (a padded vocabulary).
Tensor deferred_pad_rows(const Tensor& whole, int64_t rows);
/// Deferred `t` in another dtype and device, still without memory.
Tensor deferred_to(const Tensor& t, DType dtype, Device device);

namespace init {

/// A parameter of `shape` (float32) holding U(low, high): drawn now from `generator` (the
/// default when null), or deferred under a DeferredInit.
Tensor uniform_parameter(const Shape& shape, double low, double high,
                         Generator* generator = nullptr);
/// A parameter holding N(mean, std), as uniform_parameter.
Tensor normal_parameter(const Shape& shape, double mean, double std,
                        Generator* generator = nullptr);
/// A parameter filled with `value` (a norm's ones, a bias's zeros).
Tensor constant_parameter(const Shape& shape, double value);
/// For init.cpp: replaces deferred `t`'s recipe (kind Uniform: [a, b); Normal: mean a, std b;
/// Constant: a). False (nothing done) when `t` is not deferred.
bool set_deferred_recipe(const Tensor& t, DeferredValues::Kind kind, double a, double b);

}  // namespace init

}  // namespace weave::nn
