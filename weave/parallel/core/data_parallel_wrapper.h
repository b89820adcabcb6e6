#pragma once
// What a schedule that runs several forwards and backwards per optimizer step needs of a
// data-parallel wrapper, so that it can drive one without knowing which: a pipeline runs every
// micro-batch of a stage through the wrapper, all but the last under no_sync(), so the last
// micro-batch's backward averages what all of them accumulated, its buckets launched while that
// backward goes on. DistributedDataParallel and FullyShardedDataParallel implement it.
//
//   parallel::ProcessMesh mesh({.data = 2, .tensor = 2, .pipeline = 2});
//   parallel::DistributedDataParallel ddp(stage, {.group = mesh.data()});
//   parallel::Pipeline pipe(ddp, {.microbatches = 4, .group = mesh.pipeline()});
//   // or: parallel::FullyShardedDataParallel fsdp(stage, {.group = mesh.data()});
//   //     parallel::Pipeline pipe(fsdp, {...});  optim::AdamW opt(fsdp.parameters(), {...});
#include <vector>

#include "weave/distributed/distributed.h"
#include "weave/nn/module.h"
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
  /// What the optimizer steps in the module's place: the module's parameters (DDP), or this
  /// rank's flat shards (FSDP). A pipeline records its stage on them too, so that clipping
  /// counts every stage's gradients once.
  virtual std::vector<Tensor> trained_parameters() const = 0;
};

}  // namespace weave::parallel
