#pragma once
// What a Tensor handle points at: storage, view geometry and autograd metadata. The library's
// floors above tensor/ (autograd, ops, distributed, parallel) reach these through it; weave.h
// does not include it, and user code goes through Tensor's methods.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "weave/tensor/tensor.h"

namespace weave {

/// Base of what parallel/ records on a parameter about where it lives across ranks: its
/// placement (parallel/core/placement.h). Below parallel/ only these two questions are asked,
/// by optim::clip_grad_norm_, which refuses a spread parameter.
struct PlacementRecord {
  virtual ~PlacementRecord() = default;
  /// Whether ranks hold different pieces of the parameter (not only identical copies).
  virtual bool spread() const = 0;
  /// Where it lives and how to treat it, for an error message: "split along axis 0 over group
  /// [0, 1]; hint: ...".
  virtual std::string describe() const = 0;
};

/// Base of what parallel/ records on data cut from a whole (a sequence part:
/// parallel::shard_sequence), so that whoever consumes it can check it was cut as it expects.
struct CutRecord {
  virtual ~CutRecord() = default;
  /// "part 1 of a sequence cut zig-zag over group [0, 1] along axis 1".
  virtual std::string describe() const = 0;
};

/// Autograd state of a tensor; created on first use.
struct AutogradMeta {
  bool requires_grad = false;
  bool retains_grad = false;
  Tensor grad;
  std::shared_ptr<autograd::Node> grad_fn;
  uint32_t output_nr = 0;
  /// The AccumulateGrad node of a leaf, shared by every use of the leaf in one graph.
  std::weak_ptr<autograd::Node> grad_accumulator;
  std::vector<std::pair<uint64_t, GradHook>> leaf_hooks;
  std::vector<std::pair<uint64_t, PostAccumulateGradHook>> post_accumulate_hooks;
  /// Set on a leaf that is one rank's part of a parameter spread over several ranks (an FSDP
  /// or ZeRO flat shard, a tensor-parallel slice, a range of experts, a pipeline stage) by what
  /// spread it. Module::to carries it over.
  std::shared_ptr<const PlacementRecord> placement;
  /// Set on a module's parameter by a wrapper that trains it through tensors of its own (FSDP:
  /// its flat shards, which the optimizer steps; the parameter holds values only while its
  /// unit runs): the wrapper's name and how to reach what to step instead. An optimizer or a
  /// pipeline given the parameter itself raises with it. Empty: nobody.
  std::string managed_by;
  /// The nn::DeferredInit seed a parameter's values were drawn with (nn::materialize, or a
  /// fully sharded wrapper's draw of its shards); unset for values drawn eagerly or loaded.
  /// The ranks that hold pieces or copies of one model agree on it. Module::to carries it over.
  std::optional<uint64_t> drawn_with_seed;
  /// Set on data cut from a whole by what cut it; views and copies do not carry it.
  std::shared_ptr<const CutRecord> cut;
};

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  Shape shape;
  Strides strides;
  int64_t offset = 0;  // in elements
  DType dtype = kFloat32;
  /// The tensor this one is a view of (null if it owns its storage's layout).
  std::shared_ptr<TensorImpl> view_base;
  std::unique_ptr<AutogradMeta> autograd;

  AutogradMeta& meta() {
    if (!autograd) autograd = std::make_unique<AutogradMeta>();
    return *autograd;
  }
};

}  // namespace weave
