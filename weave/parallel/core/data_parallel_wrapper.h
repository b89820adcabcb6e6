#pragma once
// The one face of the data-parallel wrappers (DistributedDataParallel and
// FullyShardedDataParallel implement it), so that a trainer or a schedule drives one without
// knowing which: the optimizer takes param_groups(...) of trained_parameters(), checkpoints and
// exports read sharded_module(), decoding runs inside run(). A pipeline runs every micro-batch
// of a stage through the wrapper, all but the last under no_sync(), so the last micro-batch's
// backward averages what all of them accumulated, its buckets launched while that backward
// goes on.
//
//   std::unique_ptr<parallel::DataParallelWrapper> wrapper =
//       sharded ? make_fsdp(model) : make_ddp(model);           // either one
//   optim::AdamW opt(wrapper->param_groups(optim::weight_decay_groups(model, 0.1)), {...});
//   data::TrainingState state{.model = &wrapper->sharded_module(), .optimizer = &opt};
//
//   parallel::ProcessMesh mesh({.data = 2, .tensor = 2, .pipeline = 2});
//   parallel::DistributedDataParallel ddp(stage, {.group = mesh.data()});
//   parallel::Pipeline pipe(ddp, {.microbatches = 4, .group = mesh.pipeline()});
//   // or: parallel::FullyShardedDataParallel fsdp(stage, {.group = mesh.data()});
//   //     parallel::Pipeline pipe(fsdp, {...});  optim::AdamW opt(fsdp.parameters(), {...});
#include <functional>
#include <vector>

#include "weave/autograd/grad_mode.h"
#include "weave/distributed/distributed.h"
#include "weave/nn/module.h"
#include "weave/optim/optimizer.h"
#include "weave/parallel/core/no_sync.h"

namespace weave::parallel {

class DataParallelWrapper {
 public:
  virtual ~DataParallelWrapper() = default;
  /// The wrapped module's forward; outside no_sync() it starts a synchronizing step.
  virtual Tensor forward(const nn::Inputs& inputs) = 0;
  /// While the guard lives, backward accumulates locally (see no_sync.h).
  virtual NoSyncGuard no_sync() = 0;
  /// The wrapped module.
  virtual nn::Module& module() = 0;
  /// The ranks whose gradients it averages.
  virtual const dist::Group& group() const = 0;
  /// What the optimizer steps in the module's place: the module's parameters that require grad
  /// (DDP; a frozen base's are left out), or this rank's flat shards (FSDP). A pipeline records its
  /// stage on them too, so that clipping counts every stage's gradients once.
  virtual std::vector<Tensor> trained_parameters() const = 0;
  /// The tensor of trained_parameters() that holds exactly `parameter`'s values and gradient:
  /// the parameter itself (DDP), a flat of one rank holding it alone (FSDP: a vocabulary piece,
  /// each rank's own), else undefined. A pipeline sums a tied parameter's gradients there.
  virtual Tensor trained_tensor_of(const Tensor& parameter) const { return parameter; }
  /// The optimizer's parameter groups over trained_parameters(), from `groups` of the module's
  /// own parameters (optim::weight_decay_groups): those groups (DDP), or each shard in the
  /// groups of the parameters it holds elements of (FSDP).
  virtual std::vector<optim::ParamGroup> param_groups(
      const std::vector<optim::ParamGroup>& groups) const {
    return groups;
  }
  /// What sharded checkpoints and exports read: the module (DDP), or a module whose
  /// parameters are this rank's shards (FSDP).
  virtual nn::Module& sharded_module() { return module(); }
  /// The whole module's parameters and buffers on every rank (collective under FSDP).
  virtual nn::NamedTensors full_state_dict() { return module().state_dict(); }
  /// Runs `body`, which calls the module other than through forward (decoding with key/value
  /// caches), with gradients off; FSDP gathers each unit as it runs. Collective under FSDP.
  virtual void run(const std::function<void()>& body) {
    NoGradGuard no_grad;
    body();
  }
  /// False when the last synchronizing backward averaged a NaN or infinite gradient and the
  /// wrapper checks for them (check_finite), which then raised from that backward on every rank
  /// of its group: a pipeline goes on with its schedule and raises at the end of the step, on
  /// every stage. True for a wrapper that does not check.
  virtual bool gradients_finite() const { return true; }
};

}  // namespace weave::parallel
