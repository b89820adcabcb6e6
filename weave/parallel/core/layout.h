#pragma once
// How a rank's tensors are cut from the whole model: the one description every strategy gives
// and sharded checkpoints read. Two kinds of cut exist:
//
//   a split parameter       a tensor-parallel layer (a ShardedModule) holds piece `index` of
//                           `count` equal pieces of it along one axis (TensorSplit);
//   a flat shard            ZeRO-1 and FSDP concatenate parameters into one flat buffer and give
//                           each rank elements [begin, begin + numel) of it (FlatShard).
//
// A split is a fact about the module (its layers say it, tensor_splits reads it); a flat shard
// is a fact about the shard tensor, recorded on it by the strategy that made it
// (attach_flat_shard) and gone with it. No registry sits between: the checkpoint code asks the
// module and the tensors it saves.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "weave/distributed/distributed.h"
#include "weave/nn/module.h"

namespace weave::parallel {

/// A layer with parameters split across a group: says which axis of each is split.
class ShardedModule : public nn::Module {
 public:
  ShardedModule(std::string name, dist::Group group)
      : nn::Module(std::move(name)), group_(std::move(group)) {}
  /// The axis of parameter `name` (as registered here) that is split, or -1 if replicated.
  virtual int split_axis(const std::string& name) const = 0;
  const dist::Group& group() const { return group_; }

 private:
  dist::Group group_;
};

/// Parameter name -> split axis for every ShardedModule parameter inside module (names as in
/// module.named_parameters()); parameters not listed are replicated.
std::map<std::string, int> split_axes(const nn::Module& module);

/// How this rank's parameter is cut from the whole: piece `index` of `count` equal pieces
/// along `axis`.
struct TensorSplit {
  int axis = -1;
  int index = 0;
  int count = 1;
};
/// split_axes with each layer's group: what a sharded checkpoint records of every split
/// parameter, so that it loads at another tensor-parallel size.
std::map<std::string, TensorSplit> tensor_splits(const nn::Module& module);

namespace detail {

/// A split parameter and the layer that splits it (whose group says how).
struct SplitParameter {
  int axis;
  const ShardedModule* layer;
};
/// Every split parameter inside module, by its name in module.named_parameters().
std::map<std::string, SplitParameter> split_parameters(const nn::Module& module);

/// A flat shard (ZeRO-1's, FSDP's): elements [begin, begin + numel) of `members` laid out back to
/// back at `offsets`. Members are known by identity; their names and tensor-parallel splits are
/// given (FSDP knows them) or, left empty, looked up in the checkpoint's model (ZeRO-1).
struct FlatShard {
  std::vector<const void*> members;
  std::vector<std::string> names;
  std::vector<TensorSplit> splits;
  std::vector<int64_t> offsets;
  std::vector<Shape> shapes;
  int64_t begin = 0;
};
/// Records on `shard` (a leaf) that it is laid out so; the record lives as long as the tensor,
/// or until forget_flat_shard.
void attach_flat_shard(const Tensor& shard, FlatShard layout);
void forget_flat_shard(const Tensor& shard);
/// The layout attached to t, if any.
std::optional<FlatShard> flat_shard_of(const Tensor& t);

}  // namespace detail

}  // namespace weave::parallel
