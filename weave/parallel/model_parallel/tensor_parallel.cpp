// Tensor-parallel layers: each is the unsharded layer's math with the region mappings of
// dist::functional placed where the split changes (Megatron-LM's f and g operators).
#include "weave/parallel/model_parallel/tensor_parallel.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <numeric>

#include "weave/autograd/grad_mode.h"
#include "weave/distributed/functional.h"
#include "weave/nn/deferred.h"
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

Tensor split_parameter(const Tensor& full, int axis, const dist::Group& group, int64_t size) {
  if (!full.defined()) return {};
  NoGradGuard no_grad;
  const int64_t piece = full.size(axis) / group.size();
  const Tensor view = full.detach().narrow(axis, group.rank() * piece, piece);
  // A deferred whole stays deferred: the slice draws its own elements of it when materialized.
  Tensor slice = nn::is_deferred(full) ? nn::deferred_copy(view) : view.contiguous().clone();
  if (size >= 0) {
    WEAVE_CHECK(axis == 0, "split_parameter",
                "a padded whole (size {}) is split along axis 0, found axis {}", size, axis);
    record_padding(slice, group, size);
  } else {
    add_cut(slice, {.kind = Cut::Kind::Split, .group = group, .axis = axis});
  }
  return slice;
}

void record_padding(const Tensor& weight, const dist::Group& group, int64_t size) {
  const int64_t rows = weight.size(0), whole = rows * group.size();
  WEAVE_CHECK(size > 0 && size <= whole, "record_padding", "a whole of {} rows padded past {} rows",
              whole, size);
  add_cut(weight, {.kind = Cut::Kind::Split,
                   .group = group,
                   .axis = 0,
                   .size = size < whole ? size : int64_t(-1)});
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
    : ShardedModule("ColumnParallelLinear", std::move(group)),
      weight(register_parameter("weight", Tensor())),
      bias(register_parameter("bias", Tensor())),
      options_(options) {
  piece_of(out_features, this->group(), "ColumnParallelLinear", "out_features");
  WEAVE_CHECK(!(options.skip_bias_add && options.gather_output), "ColumnParallelLinear",
              "skip_bias_add leaves the bias to the caller, which gather_output would then add "
              "to a gathered output it cannot align; hint: use one of them");
  nn::Linear full(in_features, out_features, options.bias, options.generator);
  weight = split_parameter(full.weight, 0, this->group());
  weight.requires_grad_(true);
  if (options.bias) {
    bias = split_parameter(full.bias, 0, this->group());
    bias.requires_grad_(true);
  }
}

Tensor ColumnParallelLinear::forward(const Tensor& x) {
  const dist::Group& g = group();
  Tensor input =
      options_.sequence_parallel ? F::gather_from_sequence_group(x, 0, g) : F::copy_to_group(x, g);
  Tensor y = linear(input, weight, options_.skip_bias_add ? Tensor() : bias);
  return options_.gather_output ? F::gather_from_group(y, -1, g) : y;
}

RowParallelLinear::RowParallelLinear(int64_t in_features, int64_t out_features, dist::Group group,
                                     RowParallelOptions options)
    : ShardedModule("RowParallelLinear", std::move(group)),
      weight(register_parameter("weight", Tensor())),
      bias(register_parameter("bias", Tensor())),
      options_(options) {
  piece_of(in_features, this->group(), "RowParallelLinear", "in_features");
  nn::Linear full(in_features, out_features, options.bias, options.generator);
  weight = split_parameter(full.weight, 1, this->group());
  weight.requires_grad_(true);
  if (options.bias) {
    NoGradGuard no_grad;
    bias = nn::is_deferred(full.bias) ? nn::deferred_copy(full.bias) : full.bias.detach().clone();
    bias.requires_grad_(true);
  }
}

Tensor RowParallelLinear::forward(const Tensor& x) {
  const dist::Group& g = group();
  Tensor input = options_.input_is_parallel ? x : F::scatter_to_group(x, -1, g);
  Tensor partial = linear(input, weight);
  if (options_.sequence_parallel) {
    Tensor y = F::reduce_scatter_to_sequence_group(partial, 0, g);
    // each rank adds the bias to its own rows only: the gradients are summed over the group
    return bias.defined() ? y + F::copy_to_group(bias, g) : y;
  }
  Tensor y = F::reduce_from_group(partial, g);
  return bias.defined() ? y + bias : y;
}

VocabParallelEmbedding::VocabParallelEmbedding(int64_t vocab, int64_t dim, dist::Group group,
                                               Generator* generator, int64_t padded_rows)
    : ShardedModule("VocabParallelEmbedding", std::move(group)),
      weight(register_parameter("weight", Tensor())),
      vocab_(vocab) {
  const int64_t rows = padded_rows == 0 ? vocab : padded_rows;
  WEAVE_CHECK(rows >= vocab, "VocabParallelEmbedding",
              "padded_rows ({}) must be at least the vocabulary ({}); hint: padded_vocab", rows,
              vocab);
  piece_of(rows, this->group(), "VocabParallelEmbedding", "the padded vocabulary");
  nn::Embedding full(vocab, dim, generator);  // the unpadded initialization, then zero rows
  weight = split_parameter(pad_rows(full.weight.detach(), rows), 0, this->group(), vocab);
  weight.requires_grad_(true);
}

Tensor VocabParallelEmbedding::forward(const Tensor& ids) {
  const dist::Group& g = group();
  const int64_t rows = weight.size(0), start = g.rank() * rows;
  Tensor mine, local;
  {
    NoGradGuard no_grad;
    WEAVE_CHECK(ids.numel() == 0 ||
                    (min(ids).item<double>() >= 0 && max(ids).item<double>() < double(vocab_)),
                "VocabParallelEmbedding", "ids must lie in [0, {}), found [{}, {}]", vocab_,
                ids.numel() ? min(ids).item<double>() : 0,
                ids.numel() ? max(ids).item<double>() : 0);
    Tensor shifted = ids.to(kInt64) - double(start);
    Tensor inside = ge(shifted, zeros_like(shifted)).to(kInt64) *
                    lt(shifted, full_like(shifted, double(rows))).to(kInt64);
    mine = ne(inside, zeros_like(inside));
    local = where(mine, shifted, zeros_like(shifted));
  }
  Tensor rows_here = embedding(weight, local) * unsqueeze(mine, -1).to(weight.dtype());
  return F::reduce_from_group(rows_here, g);
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

Tensor vocab_parallel_cross_entropy(const Tensor& logits, const Tensor& targets,
                                    const dist::Group& group, bool mean) {
  WEAVE_CHECK(logits.dim() == 2 && targets.dim() == 1 && targets.size(0) == logits.size(0),
              "vocab_parallel_cross_entropy",
              "expected logits [N, V/n] and targets [N], found {} and {}", logits.shape(),
              targets.shape());
  WEAVE_CHECK(!is_floating(targets.dtype()), "vocab_parallel_cross_entropy",
              "targets must be integer class ids, found {}", targets.dtype());
  const int64_t piece = logits.size(1), start = group.rank() * piece;
  Tensor global_max, other;
  {
    // the shift only keeps exp() finite: any constant per row gives the same loss and
    // gradient, so it is taken out of the graph
    NoGradGuard no_grad;
    global_max = max(logits.detach(), {1}, true).contiguous();
    if (group.size() > 1) dist::all_reduce(global_max, dist::ReduceOp::Max, group);
    Tensor columns = arange(double(start), double(start + piece), 1.0, {.dtype = kInt64});
    other = ne(unsqueeze(targets.to(kInt64), 1), unsqueeze(columns, 0));
  }
  Tensor shifted = logits - global_max;
  Tensor sum_exp = F::reduce_from_group(sum(exp(shifted), {1}), group);
  // masked, not multiplied by a 0/1 mask: padding columns at -infinity would make 0 * -inf
  Tensor target_logit = F::reduce_from_group(sum(masked_fill(shifted, other, 0.0), {1}), group);
  Tensor losses = log(sum_exp) - target_logit;
  return mean ? losses.mean() : losses.sum();
}

int64_t padded_vocab(int64_t vocab, int n) {
  WEAVE_CHECK(vocab > 0 && n > 0, "padded_vocab",
              "expected a vocabulary and ranks, found {} and {}", vocab, n);
  if (vocab % n == 0) return vocab;
  const int64_t multiple = std::lcm(int64_t{128}, int64_t(n));
  return (vocab + multiple - 1) / multiple * multiple;
}

Tensor vocab_parallel_logits(const Tensor& logits, int64_t vocab, const dist::Group& group,
                             bool gather) {
  const int64_t piece = logits.size(-1), start = group.rank() * piece;
  const bool padded = piece * group.size() > vocab;
  if (gather) {
    Tensor all = F::all_gather(logits, -1, group);
    return padded ? all.narrow(-1, 0, vocab) : all;
  }
  if (!padded || start + piece <= vocab) return logits;
  Tensor past;  // this rank's columns past the vocabulary
  {
    NoGradGuard no_grad;
    past = ge(arange(double(start), double(start + piece), 1.0,
                     {.dtype = kInt64, .device = logits.device()}),
              full({piece}, double(vocab), {.dtype = kInt64, .device = logits.device()}));
  }
  return masked_fill(logits, past, -std::numeric_limits<double>::infinity());
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
