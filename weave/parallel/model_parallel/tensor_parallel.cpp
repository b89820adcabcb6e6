// Tensor-parallel layers: each is the unsharded layer's math with the region mappings of
// dist::functional placed where the split changes (Megatron-LM's f and g operators).
#include "weave/parallel/model_parallel/tensor_parallel.h"

#include <algorithm>
#include <functional>

#include "weave/autograd/grad_mode.h"
#include "weave/distributed/functional.h"
#include "weave/nn/deferred.h"
#include "weave/nn/lora.h"
#include "weave/parallel/core/placement.h"
#include "weave/tensor/tensor_impl.h"

namespace weave::parallel {

namespace F = dist::functional;

int64_t piece_of(int64_t size, const dist::Group& group, const char* layer, const char* what) {
  WEAVE_CHECK(size % group.size() == 0, layer,
              "{} is {}, which does not divide among the {} ranks of group {}; hint: pad it to a "
              "multiple of the group size",
              what, size, group.size(), group.str());
  return size / group.size();
}

Tensor split_parameter(const Tensor& full, int axis, const dist::Group& group, int64_t size,
                       bool across_batches) {
  if (!full.defined()) return {};
  NoGradGuard no_grad;
  const int64_t piece = full.size(axis) / group.size();
  const Tensor view = full.detach().narrow(axis, group.rank() * piece, piece);
  // A deferred whole stays deferred: the slice draws its own elements of it when materialized.
  Tensor slice = nn::is_deferred(full) ? nn::deferred_copy(view) : view.contiguous().clone();
  if (size >= 0) {
    WEAVE_CHECK(axis == 0, "split_parameter",
                "a padded whole (size {}) is split along axis 0, found axis {}", size, axis);
    record_padding(slice, group, size, across_batches);
  } else {
    add_cut(
        slice,
        {.kind = Cut::Kind::Split, .group = group, .axis = axis, .across_batches = across_batches});
  }
  return slice;
}

void record_padding(const Tensor& weight, const dist::Group& group, int64_t size,
                    bool across_batches) {
  const int64_t rows = weight.size(0), whole = rows * group.size();
  WEAVE_CHECK(size > 0 && size <= whole, "record_padding", "a whole of {} rows padded past {} rows",
              whole, size);
  add_cut(weight, {.kind = Cut::Kind::Split,
                   .group = group,
                   .axis = 0,
                   .size = size < whole ? size : int64_t(-1),
                   .across_batches = across_batches});
  // The padding rows are zero wherever they come from: nothing looks them up, so nothing else
  // would keep them finite through a checkpoint or an optimizer's weight decay.
  const int64_t first = std::clamp<int64_t>(size - group.rank() * rows, 0, rows);
  if (first == rows || nn::is_deferred(weight)) return;  // deferred padding is drawn as zeros
  NoGradGuard no_grad;
  weight.narrow(0, first, rows - first).zero_();
}

Tensor pad_rows(const Tensor& whole, int64_t rows) {
  WEAVE_CHECK(rows >= whole.size(0), "pad_rows", "{} rows cannot be padded to {}", whole.size(0),
              rows);
  if (rows == whole.size(0)) return whole;
  if (nn::is_deferred(whole)) return nn::deferred_pad_rows(whole, rows);
  Shape padding = whole.shape();
  padding[0] = rows - whole.size(0);
  return cat({whole, zeros(padding, {.dtype = whole.dtype(), .device = whole.device()})});
}

ColumnParallelLinear::ColumnParallelLinear(int64_t in_features, int64_t out_features,
                                           dist::Group group, ColumnParallelOptions options)
    : nn::LinearLeaf("ColumnParallelLinear"), group_(std::move(group)), options_(options) {
  piece_of(out_features, group_, "ColumnParallelLinear", "out_features");
  WEAVE_CHECK(!(options.skip_bias_add && options.gather_output), "ColumnParallelLinear",
              "skip_bias_add leaves the bias to the caller, which gather_output would then add "
              "to a gathered output it cannot align; hint: use one of them");
  nn::Linear full(in_features, out_features, options.bias, options.generator);
  set_parameters(split_parameter(full.weight, 0, group_),
                 options.bias ? split_parameter(full.bias, 0, group_) : Tensor());
}

namespace {

// An adapter's factors for a column piece: A whole (drawn first, as PEFT draws it), B's rows cut.
nn::LowRankFactors column_factors(int64_t in, int64_t out, int64_t rank, const dist::Group& group,
                                  Generator& generator, DType dtype) {
  nn::LowRankFactors whole = nn::low_rank_factors(in, out, rank, generator, dtype);
  return {whole.a, split_parameter(whole.b, 0, group)};
}

}  // namespace

nn::LowRankFactors ColumnParallelLinear::adapter_factors(int64_t rank, Generator& generator,
                                                         DType dtype) const {
  return column_factors(weight.size(1), weight.size(0) * group_.size(), rank, group_, generator,
                        dtype);
}

Tensor ColumnParallelLinear::project(const Tensor& x, const Tensor& with_bias) {
  const int axis = options_.sequence_axis;
  Tensor input = options_.sequence_parallel ? F::gather_from_sequence_group(x, axis, group_)
                                            : F::copy_to_group(x, group_);
  Tensor y = linear(input, weight, with_bias);
  if (adapter) y = y + adapter->update(input, F::copy_to_group(adapter->A, group_), adapter->B);
  return options_.gather_output ? F::gather_from_group(y, -1, group_) : y;
}

Tensor ColumnParallelLinear::forward(const Tensor& x) {
  return project(x, options_.skip_bias_add ? Tensor() : bias);
}

Tensor ColumnParallelLinear::forward_unbiased(const Tensor& x) {
  return project(x, Tensor());
}

RowParallelLinear::RowParallelLinear(int64_t in_features, int64_t out_features, dist::Group group,
                                     RowParallelOptions options)
    : nn::LinearLeaf("RowParallelLinear"), group_(std::move(group)), options_(options) {
  piece_of(in_features, group_, "RowParallelLinear", "in_features");
  nn::Linear full(in_features, out_features, options.bias, options.generator);
  Tensor replicated;
  if (options.bias) {
    NoGradGuard no_grad;
    replicated =
        nn::is_deferred(full.bias) ? nn::deferred_copy(full.bias) : full.bias.detach().clone();
  }
  set_parameters(split_parameter(full.weight, 1, group_), replicated);
}

nn::LowRankFactors RowParallelLinear::adapter_factors(int64_t rank, Generator& generator,
                                                      DType dtype) const {
  nn::LowRankFactors whole =
      nn::low_rank_factors(weight.size(1) * group_.size(), weight.size(0), rank, generator, dtype);
  return {split_parameter(whole.a, 1, group_), whole.b};
}

Tensor RowParallelLinear::forward_unbiased(const Tensor& x) {
  Tensor input = options_.input_is_parallel ? x : F::scatter_to_group(x, -1, group_);
  Tensor partial = linear(input, weight);
  if (adapter)  // the update's partial products join the base's sum
    partial = partial + adapter->update(input, adapter->A, F::copy_to_group(adapter->B, group_));
  if (options_.sequence_parallel)
    return F::reduce_scatter_to_sequence_group(partial, options_.sequence_axis, group_);
  return F::reduce_from_group(partial, group_);
}

Tensor RowParallelLinear::forward(const Tensor& x) {
  Tensor y = forward_unbiased(x);
  if (!bias.defined()) return y;
  // Under sequence parallelism each rank adds the bias to its own rows only: the gradients are
  // summed over the group.
  return y + (options_.sequence_parallel ? F::copy_to_group(bias, group_) : bias);
}

TensorParallelLinears::TensorParallelLinears(dist::Group group, TensorParallelOptions options)
    : group_(std::move(group)), options_(options) {}

std::shared_ptr<const nn::Linears> tensor_parallel(const dist::Group& group,
                                                   TensorParallelOptions options) {
  return std::make_shared<TensorParallelLinears>(group, options);
}

std::shared_ptr<nn::LinearLeaf> TensorParallelLinears::column(int64_t in, int64_t out, bool bias,
                                                              Generator* generator) const {
  return std::make_shared<ColumnParallelLinear>(
      in, out, group_,
      ColumnParallelOptions{
          .bias = bias, .sequence_parallel = options_.sequence_parallel, .generator = generator});
}

std::shared_ptr<nn::LinearLeaf> TensorParallelLinears::row(int64_t in, int64_t out, bool bias,
                                                           Generator* generator) const {
  return std::make_shared<RowParallelLinear>(
      in, out, group_,
      RowParallelOptions{
          .bias = bias, .sequence_parallel = options_.sequence_parallel, .generator = generator});
}

nn::StackedProjection TensorParallelLinears::stacked(int64_t in, int64_t width, bool bias,
                                                     Generator* generator) const {
  piece_of(width, group_, "TensorParallelLinears", "a stacked projection's width");
  // The whole projection's initialization, then cut along width.
  const nn::StackedProjection whole = nn::stacked_projection(in, width, bias, generator);
  return {split_parameter(whole.weight, 1, group_), split_parameter(whole.bias, 1, group_)};
}

Tensor TensorParallelLinears::enter(const Tensor& x) const {
  return options_.sequence_parallel ? F::gather_from_sequence_group(x, 1, group_)
                                    : F::copy_to_group(x, group_);
}

Tensor TensorParallelLinears::apply_stacked(const Tensor& x, const Tensor& weight,
                                            const Tensor& bias,
                                            const nn::StackedAdapters& adapters) const {
  const Tensor input = enter(x);
  return nn::add_stacked_updates(
      nn::apply_stacked(input, weight, bias), input, adapters,
      [this](const Tensor& a) { return shared_by_parts(a); }, [](const Tensor& b) { return b; });
}

nn::LowRankFactors TensorParallelLinears::column_adapter(int64_t in, int64_t out, int64_t rank,
                                                         Generator& generator, DType dtype) const {
  return column_factors(in, out, rank, group_, generator, dtype);
}

std::pair<nn::StackedProjection, nn::Linears::KeyValueHeads> TensorParallelLinears::key_values(
    int64_t dim, int64_t heads, int64_t kv_heads, int64_t head_dim, bool bias,
    Generator* generator) const {
  const int64_t n = group_.size();
  const nn::StackedProjection whole =
      nn::stacked_projection(dim, kv_heads * head_dim, bias, generator);
  if (kv_heads % n == 0)
    return {{split_parameter(whole.weight, 1, group_), split_parameter(whole.bias, 1, group_)},
            {kv_heads / n, 0, false}};
  // Fewer key/value heads than ranks: every rank holds them all and projects the one its
  // queries read (the head of its first query head).
  const int64_t first = group_.rank() * (heads / n) / (heads / kv_heads);
  return {whole, {1, first, true}};
}

Tensor TensorParallelLinears::project_key_values(const Tensor& x, const Tensor& weight,
                                                 const Tensor& bias, const KeyValueHeads& heads,
                                                 int64_t head_dim,
                                                 const nn::StackedAdapters& adapters) const {
  if (!heads.replicated) return apply_stacked(x, weight, bias, adapters);
  // Each rank's queries read only their head of the whole projection (and of its adapters' B):
  // its gradient is summed over the group, as the input's.
  const int64_t rows = heads.local * head_dim, first = heads.first * head_dim;
  const Tensor w = shared_by_parts(weight).narrow(1, first, rows);
  const Tensor b = bias.defined() ? shared_by_parts(bias).narrow(1, first, rows) : Tensor();
  const Tensor input = enter(x);
  return nn::add_stacked_updates(
      nn::apply_stacked(input, w, b), input, adapters,
      [this](const Tensor& a) { return shared_by_parts(a); },
      [&](const Tensor& factor) { return shared_by_parts(factor).narrow(0, first, rows); });
}

Tensor TensorParallelLinears::shared_by_parts(const Tensor& parameter) const {
  return F::copy_to_group(parameter, group_);
}

std::shared_ptr<nn::Module> TensorParallelLinears::layer_norm(const Shape& shape,
                                                              double eps) const {
  if (options_.sequence_parallel)
    return std::make_shared<SequenceParallelLayerNorm>(shape, group_, eps);
  return std::make_shared<nn::LayerNorm>(shape, eps);
}

void TensorParallelLinears::check_decoding(const char* layer) const {
  WEAVE_CHECK(!options_.sequence_parallel, layer,
              "decoding with a key/value cache needs the whole sequence on every rank, found "
              "sequence parallelism; hint: decode with the model built without it (the "
              "parameters are the same)");
}

SequenceParallelLayerNorm::SequenceParallelLayerNorm(const Shape& normalized_shape,
                                                     dist::Group group, double eps)
    : ShardedModule("SequenceParallelLayerNorm", std::move(group)),
      weight(register_parameter("weight", nn::init::constant_parameter(normalized_shape, 1))),
      bias(register_parameter("bias", nn::init::constant_parameter(normalized_shape, 0))),
      shape_(normalized_shape),
      eps_(eps) {}

Tensor SequenceParallelLayerNorm::forward(const Tensor& x) {
  return layer_norm(x, shape_, F::copy_to_group(weight, group()), F::copy_to_group(bias, group()),
                    eps_);
}

nn::NamedTensors shard_state_dict(const nn::NamedTensors& full, const nn::Module& sharded) {
  const auto splits = detail::split_parameters(sharded);
  std::map<std::string, Shape> local;
  for (const auto& [name, p] : sharded.named_parameters()) local[name] = p.shape();
  nn::NamedTensors out;
  for (const auto& [name, t] : full) {
    auto it = splits.find(name);
    if (it == splits.end()) {
      out.emplace_back(name, t);
      continue;
    }
    const dist::Group& g = it->second.group;
    Tensor whole = t;
    if (it->second.size >= 0 && t.size(0) == it->second.size)  // pad the vocabulary
      whole = pad_rows(t, local.at(name)[0] * g.size());
    piece_of(whole.size(it->second.axis), g, "shard_state_dict", name.c_str());
    out.emplace_back(name, split_parameter(whole, it->second.axis, g, it->second.size));
  }
  return out;
}

nn::NamedTensors gather_state_dict(const nn::Module& sharded) {
  const auto splits = detail::split_parameters(sharded);
  NoGradGuard no_grad;
  nn::NamedTensors out;
  for (const auto& [name, t] : sharded.state_dict()) {
    auto it = splits.find(name);
    if (it == splits.end()) {
      out.emplace_back(name, t.detach().clone());
      continue;
    }
    Tensor whole = F::all_gather(t.detach(), it->second.axis, it->second.group);
    if (it->second.size >= 0) whole = whole.narrow(0, 0, it->second.size).contiguous();
    out.emplace_back(name, whole);
  }
  return out;
}

}  // namespace weave::parallel
