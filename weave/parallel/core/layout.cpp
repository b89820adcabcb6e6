// Layouts: split parameters found by walking the module, flat shards recorded on their tensors.
#include "weave/parallel/core/layout.h"

#include <memory>

#include "weave/tensor/tensor_impl.h"

namespace weave::parallel {

namespace {

struct RecordedFlatShard final : SpreadLayout {
  explicit RecordedFlatShard(detail::FlatShard l) : layout(std::move(l)) {}
  detail::FlatShard layout;
};

void walk(const nn::Module& module, const std::string& prefix,
          std::map<std::string, detail::SplitParameter>& out) {
  if (const auto* sharded = dynamic_cast<const ShardedModule*>(&module))
    for (const auto& [name, t] : module.named_parameters(false))
      if (t.defined() && sharded->split_axis(name) >= 0)
        out[prefix + name] = {sharded->split_axis(name), sharded};
  for (const auto& [name, child] : module.named_children())
    walk(*child, nn::member_prefix(prefix, name), out);
}

}  // namespace

std::map<std::string, int> split_axes(const nn::Module& module) {
  std::map<std::string, int> out;
  for (const auto& [name, split] : detail::split_parameters(module)) out[name] = split.axis;
  return out;
}

std::map<std::string, TensorSplit> tensor_splits(const nn::Module& module) {
  std::map<std::string, TensorSplit> out;
  for (const auto& [name, split] : detail::split_parameters(module))
    out[name] = {split.axis, split.layer->group().rank(), split.layer->group().size()};
  return out;
}

namespace detail {

std::map<std::string, SplitParameter> split_parameters(const nn::Module& module) {
  std::map<std::string, SplitParameter> out;
  walk(module, "", out);
  return out;
}

void attach_flat_shard(const Tensor& shard, FlatShard layout) {
  shard.impl()->meta().spread_layout = std::make_shared<RecordedFlatShard>(std::move(layout));
}

void forget_flat_shard(const Tensor& shard) {
  if (shard.defined() && shard.impl()->autograd) shard.impl()->autograd->spread_layout.reset();
}

std::optional<FlatShard> flat_shard_of(const Tensor& t) {
  if (!t.defined() || !t.impl()->autograd) return std::nullopt;
  const auto* recorded =
      dynamic_cast<const RecordedFlatShard*>(t.impl()->autograd->spread_layout.get());
  if (!recorded) return std::nullopt;
  return recorded->layout;
}

}  // namespace detail

}  // namespace weave::parallel
