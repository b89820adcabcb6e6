#pragma once
// One call that wraps a model for the mesh's data axes, so that a trainer is written once for
// every layout (torchtitan's parallelize_*, data half): DistributedDataParallel over the data x
// context ranks, FullyShardedDataParallel sharding over them, HSDP when the mesh splits its data
// axis into replicas (MeshShape::replicate), or a pass-through on one replica. The result is
// never null, so the trainer has no "wrapper or model" branch; parallel::Pipeline takes it.
//
//   parallel::ProcessMesh mesh({.data = 4, .replicate = 2, .pipeline = 2});
//   models::Llama stage(options, models::ModelSplit::from_mesh(mesh));
//   auto wrapper = parallel::data_parallel(stage, mesh, {.shard = true});     // HSDP 2 x 2
//   parallel::Pipeline pipe(*wrapper, {.microbatches = 4, .group = mesh.pipeline()});
//   optim::AdamW opt(wrapper->trained_parameters(), {.lr = 1e-4});
//   Tensor loss = pipe.train_step(x, y, loss_fn);      // the last stage's; undefined elsewhere
//   double mean = parallel::replica_mean(loss, mesh);  // every rank: the whole batch's loss
#include <memory>

#include "weave/parallel/core/data_parallel_wrapper.h"
#include "weave/parallel/core/mesh.h"
#include "weave/parallel/data_parallel/ddp.h"
#include "weave/parallel/data_parallel/fsdp.h"

namespace weave::parallel {

struct DataParallelOptions {
  /// FSDP: parameters sharded over mesh.shard() (the data x context ranks, or under HSDP one
  /// replica's), each shard averaged over mesh.replicate() when the mesh has replicas. false:
  /// DDP over the data x context ranks (a pass-through when there is one).
  bool shard = false;
  /// FSDP's options; its group and replicate_group come from the mesh (leave them unset).
  FSDPOptions fsdp{};
  /// DDP's options; its group comes from the mesh (leave it unset).
  DDPOptions ddp{};
  /// Average nothing here: the optimizer averages the gradients in its step
  /// (ZeroRedundancyOptimizer, DistributedOptimizer over mesh.data_and_context()). The wrapper
  /// is then the model itself behind the wrappers' face, whatever the mesh; not with shard.
  bool optimizer_averages = false;
};

/// `model` wrapped for the mesh's data axes as `options` say; collective over the data x context
/// ranks (the wrappers' construction). Raises on every rank for groups set in the options, for
/// replicas (MeshShape::replicate > 1) without sharding (DDP has no replicate axis), and for
/// optimizer_averages with shard.
std::unique_ptr<DataParallelWrapper> data_parallel(nn::Module& model, const ProcessMesh& mesh,
                                                   DataParallelOptions options = {});

/// A step's loss averaged over the data x context ranks, on every rank of the mesh: each holds
/// the mean over its equal share of the batch, and under a pipeline only the last stage holds
/// one (undefined elsewhere). Detached; collective over data x context x pipeline.
double replica_mean(const Tensor& loss, const ProcessMesh& mesh);

}  // namespace weave::parallel
