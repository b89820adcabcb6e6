#pragma once
// How a rank's tensors are cut from the whole model: the data a placement (placement.h) carries
// for the two of its four kinds of cut (Split, FlatShard, Experts, Stage) that sharded
// checkpoints must undo:
//
//   a split parameter       a tensor-parallel layer (a ShardedModule) holds piece `index` of
//                           `count` equal pieces of it along one axis (TensorSplit: the
//                           placement's Split cut);
//   a flat shard            ZeRO-1 and FSDP concatenate parameters into one flat buffer and give
//                           each rank elements [begin, begin + numel) of it (FlatShard: the
//                           layout of the placement's FlatShard cut).
//
// Both are facts about the tensor, recorded on it by what cut it and gone with it: no registry
// sits between, and nothing walks the module to find them.
#include <cstdint>
#include <string>
#include <vector>

#include "weave/distributed/distributed.h"
#include "weave/nn/module.h"

namespace weave::parallel {

/// A layer with parameters split across a group (its parameters carry Split cuts).
class ShardedModule : public nn::Module {
 public:
  ShardedModule(std::string name, dist::Group group)
      : nn::Module(std::move(name)), group_(std::move(group)) {}
  const dist::Group& group() const { return group_; }

 private:
  dist::Group group_;
};

/// How this rank's parameter is cut from the whole: piece `index` of `count` equal pieces
/// along `axis`. A whole padded to divide among the ranks (a vocabulary: padded_vocab) has
/// `size` < count x piece along axis 0: the elements past it are padding, in no whole tensor.
struct TensorSplit {
  int axis = -1;
  int index = 0;
  int count = 1;
  int64_t size = -1;  // -1: count x the piece's length
};

namespace detail {

/// A split parameter: the axis, and the group whose ranks hold its pieces in order.
struct SplitParameter {
  int axis;
  dist::Group group;
  int64_t size = -1;  // TensorSplit::size
};

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

}  // namespace detail

}  // namespace weave::parallel
