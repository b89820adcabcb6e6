#pragma once
// One FSDP unit (internal; PyTorch FSDP2's FSDPParamGroup): the modules whose parameters are
// gathered together, their parameters in flat buffers (one per dtype and device), and the
// collectives that move them. The unit's memory life cycle, over one training step:
//
//   params   Sharded --launch_gather--> Gathering --wait_gather--> Gathered --release--> Sharded
//            (only this rank's shard is    (all_gather in flight,    (the whole parameters,
//             allocated)                    the memory allocated)     what forward/backward read)
//   grads    Idle --bind_grads--> Accumulating --launch_reduce--> Reducing --finish_reduce--> Idle
//                  (whole gradient buffers;        (reduce_scatter in      (this rank's averaged
//                   backward accumulates there)     flight)                 shard in `reduced`)
//
// Under ShardGradOp the parameters are never released: they stay Gathered between uses and are
// gathered again only after the optimizer changed the shard.
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "weave/distributed/distributed.h"
#include "weave/nn/module.h"
#include "weave/parallel/core/flat_buffer.h"
#include "weave/parallel/core/placement.h"
#include "weave/parallel/core/reproducible.h"
#include "weave/parallel/data_parallel/fsdp.h"

namespace weave::parallel::detail {

/// One dtype's (and device's) parameters of a unit, flat, sharded over the ranks that hold
/// copies of them: the wrapper's group, or for spread experts their expert-data group.
struct FSDPFlat {
  std::vector<int> params;  // indices into the wrapper's parameter list
  dist::Group group;        // the ranks sharing this buffer
  double scale = 1.0;       // what the average is multiplied by (an expert's 1 / expert group)
  std::string suffix;       // "" for the wrapper's group, "_experts", "_experts2", ..., "_frozen"
  bool frozen = false;      // parameters that do not require grad: gathered, never reduced
  // Sharded over one rank (a vocabulary piece split across batches: each rank its own): the
  // shard is the parameters' memory itself, never gathered, released or reduced.
  bool alone = false;
  FlatBuffer full;  // the gathered parameters (the params' memory); released between uses
  Tensor shard;     // this rank's slice, a leaf of its own: what the optimizer steps
  DType reduce_dtype = kFloat32;  // what the gradients travel in (FSDPOptions::reduce_dtype)
  Tensor gather_send;  // the shard in the gathered dtype, while its all_gather is in flight
  Tensor grads_wire;   // the whole gradients in reduce_dtype, while they are reduced
  std::optional<dist::Group> replicate;        // HSDP: the ranks holding this same shard
  std::optional<dist::Work> replicate_reduce;  // the average of `reduced` over them, in flight
  uint64_t gathered_version = ~uint64_t{0};    // shard's version when `full` was last gathered
  std::optional<dist::Work> gather;            // in flight
  // Set while a gather refills released memory with unchanged values: it puts the storage's
  // version back, so the tensors autograd saved from the parameters in forward stay valid.
  std::optional<uint64_t> refill_version;
  FlatBuffer grads;  // whole gradients while Accumulating or Reducing
  Tensor reduced;    // this step's averaged shard gradient, added to shard.grad at the end
  std::optional<dist::Work> reduce;  // in flight
  // FSDPOptions::reproducible: the micro-batches' binned sums, reduced at the end of the step.
  std::shared_ptr<ReproducibleGradients> sums;
};

class FSDPUnit {
 public:
  enum class Params { Sharded, Gathering, Gathered };
  enum class Grads { Idle, Accumulating, Reducing };

  /// A unit of `modules` (none for the root unit, which holds every parameter no other unit
  /// owns) over `members`, indices into `params` (named `names`, split as `splits` says), each
  /// sharded over its replica group: each rank keeps a 1/n slice of every flat buffer.
  /// The gathered parameters take `precision.param_dtype` and the gradients travel in
  /// `precision.reduce_dtype` when set (the shards keep the parameters' dtype).
  FSDPUnit(std::string name, std::vector<nn::Module*> modules, bool root,
           const std::vector<int>& members, const std::vector<Tensor>& params,
           const std::vector<std::string>& names, const std::map<std::string, TensorSplit>& splits,
           const ReplicaGroups& replicas, const FSDPOptions& precision);

  const std::string& name() const { return name_; }
  const std::vector<nn::Module*>& modules() const { return modules_; }
  bool root() const { return root_; }
  std::vector<FSDPFlat>& flats() { return flats_; }
  const std::vector<FSDPFlat>& flats() const { return flats_; }
  Params params_phase() const { return params_; }
  Grads grads_phase() const { return grads_; }

  /// Where this unit stands in the current step: what its hooks did so far, so that a rank
  /// that stops early can replay the rest (FSDP's State reads and resets them).
  struct StepMarks {
    bool forward_began = false;    // this forward's pre-forward ran
    bool backward_began = false;   // this step's backward gathered it
    int64_t forward_start_ns = 0;  // when its forward began (for the trace)
  };
  StepMarks& marks() { return marks_; }
  /// A new forward; `with_backward` (grad mode on): a new step's backward follows it.
  void new_forward(bool with_backward) {
    marks_.forward_began = false;
    if (with_backward) marks_.backward_began = false;
  }

  /// Starts the all_gathers of the flats whose gathered parameters are missing or stale.
  void launch_gather(FSDPStats& stats, bool prefetch);
  void wait_gather();
  void ensure_gathered(FSDPStats& stats);
  /// Completes a pending gather, then frees the gathered parameters (FullShard only).
  void release(bool full_shard);

  /// Whole-gradient buffers, the parameters' .grad bound into them so backward accumulates in
  /// place (what no_sync micro-batches accumulated is kept).
  void bind_grads(const std::vector<Tensor>& params);
  /// Starts the reduce_scatters (averages) of the whole gradients into `reduced`.
  void launch_reduce(const std::vector<Tensor>& params, FSDPStats& stats);
  /// Completes the reduce_scatters and drops the whole gradients. A reduce_scatter that raised
  /// (its agreement check failed) leaves no average; the first such error is rethrown after
  /// every flat is back to Idle.
  void finish_reduce(const std::vector<Tensor>& params);
  /// HSDP: completes the averages over the replicate groups that finish_reduce started, and
  /// converts the averaged shard gradients to the shards' dtype.
  void finish_replicate();
  /// A step every rank discards: waits for what is in flight (dropping its errors, which the
  /// step already reported), unbinds and drops the whole gradients, Accumulating ones included,
  /// and the averages.
  void discard_step(const std::vector<Tensor>& params);
  /// Adds `reduced` to the shards' gradients (when `keep`), then drops it.
  void settle_reduced(bool keep);

  /// The parameters of one flat, as the model holds them.
  static std::vector<Tensor> members(const FSDPFlat& f, const std::vector<Tensor>& params);

 private:
  std::string name_;
  std::vector<nn::Module*> modules_;
  bool root_;
  std::vector<FSDPFlat> flats_;
  Params params_ = Params::Gathered;  // the parameters are the model's until the first release
  Grads grads_ = Grads::Idle;
  StepMarks marks_;
};

}  // namespace weave::parallel::detail
