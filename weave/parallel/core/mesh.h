#pragma once
// Process meshes: a world of data x context x tensor x pipeline ranks, with one group of each
// kind per rank (Megatron's layout: tensor-parallel ranks adjacent, then context, then data, then
// pipeline), and experts spread over a sub-axis of data x context.
//
//   parallel::ProcessMesh mesh({.data = 2, .tensor = 2});   // 4 ranks
//   parallel::ColumnParallelLinear fc(784, 256, mesh.tensor());
//   parallel::DistributedDataParallel ddp(model, {.group = mesh.data()});
//
//   parallel::ProcessMesh moe_mesh({.data = 4, .expert = 2});             // 4 ranks
//   parallel::ExpertParallelMoE moe(options, moe_mesh.expert());           // experts over 2
//   moe_mesh.group({parallel::Axis::ExpertData});   // where an expert's replicas average
//
// Rank r sits at tensor index r % T, context index (r / T) % C, data index (r / (T C)) % D,
// pipeline index r / (T C D). Context ranks hold parts of one sequence
// (parallel::ring_attention): they read the same batch, and the replicated parameters' gradients
// are averaged over data and context together (mesh.data_and_context()).
// Expert parallelism (Megatron-core's expert and expert-data groups): number the data x context
// ranks of one tensor and pipeline coordinate i = context + C data; expert index i % E, expert
// replica index i / E. mesh.expert() holds E ranks that together hold every expert;
// group({Axis::ExpertData}) the ranks holding the same experts.
// HSDP (torchtitan's dp_replicate x dp_shard): `replicate` splits the data axis into replicate
// x shard, shard fastest: data index d is shard index d % (D / R), replica index d / (D / R).
// FSDP shards over mesh.shard() and averages each shard over mesh.replicate():
//
//   parallel::ProcessMesh mesh({.data = 4, .replicate = 2});   // shards {0, 1}, {2, 3}
//   parallel::FullyShardedDataParallel hsdp(model, {.group = mesh.shard(),
//                                                   .replicate_group = mesh.replicate()});
// Every rank must construct the mesh (it creates groups, a collective step).
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "weave/distributed/distributed.h"

namespace weave::parallel {

struct MeshShape {
  int data = 1;
  int tensor = 1;
  int pipeline = 1;
  int context = 1;
  /// Ranks the experts are spread over: a sub-axis of data x context (it divides their product).
  int expert = 1;
  /// HSDP: the data axis as `replicate` replicas of data / replicate shard ranks (it divides
  /// data).
  int replicate = 1;
};

/// A mesh axis. Expert and ExpertData cut data x context another way: a set of axes takes them
/// or Data and Context, not both.
enum class Axis { Data, Tensor, Pipeline, Context, Expert, ExpertData };

class ProcessMesh {
 public:
  /// Splits the world; data * context * tensor * pipeline must equal the world size.
  explicit ProcessMesh(MeshShape shape);

  const MeshShape& shape() const { return shape_; }
  /// This rank's groups: the ranks that differ from it only in that coordinate.
  const dist::Group& data() const { return data_; }
  const dist::Group& tensor() const { return tensor_; }
  const dist::Group& pipeline() const { return pipeline_; }
  const dist::Group& context() const { return context_; }
  /// The ranks that differ from this one in data or context coordinates: where the gradients of
  /// parameters replicated over both are averaged.
  const dist::Group& data_and_context() const { return group({Axis::Data, Axis::Context}); }
  /// HSDP's groups: the ranks that differ from this one in their shard index or context
  /// coordinate (where FSDP shards; data_and_context() without replicas), and those that differ
  /// in their replica index only (where each shard is averaged; this rank alone without).
  const dist::Group& shard() const { return shard_; }
  const dist::Group& replicate() const { return replicate_; }
  /// The ranks that hold the pieces of a vocabulary split over tensor x shard (the same pipeline
  /// stage and replica), tensor-major: rank tensor_rank() x shard().size() + shard().rank()
  /// (parallel::VocabularyGroups). shard() itself without tensor ranks.
  const dist::Group& vocabulary() const { return vocabulary_; }
  /// The ranks that together hold every expert (same tensor and pipeline coordinates).
  const dist::Group& expert() const { return group({Axis::Expert}); }
  /// The ranks that differ from this one only in the coordinates of `axes`: group({Data,
  /// Context}) averages dense gradients under context parallelism, group({ExpertData}) an
  /// expert's. Every set is created with the mesh; a set mixing Data or Context with Expert or
  /// ExpertData raises.
  const dist::Group& group(std::initializer_list<Axis> axes) const;
  /// This rank's coordinates.
  int data_rank() const { return data_.rank(); }
  int tensor_rank() const { return tensor_.rank(); }
  int pipeline_rank() const { return pipeline_.rank(); }
  int context_rank() const { return context_.rank(); }
  int expert_rank() const { return expert().rank(); }
  /// The global rank at the given coordinates.
  int rank_at(int data, int tensor, int pipeline, int context = 0) const;
  /// "mesh data=2 tensor=2 pipeline=1; rank 3: data [1, 3] tensor [2, 3] pipeline [3]", with
  /// each context or expert axis of more than one rank, and HSDP's shard and replicate groups
  /// ("... replicate=2; rank 3: ... shard [2, 3] replicate [1, 3]").
  std::string str() const;

 private:
  MeshShape shape_;
  dist::Group data_, tensor_, pipeline_, context_, shard_, replicate_, vocabulary_;
  std::map<unsigned, dist::Group> groups_;       // by the set of axes, as a bit mask
  std::shared_ptr<const MeshShape> registered_;  // alive while a copy of this mesh is
};

namespace detail {
/// The group of a data-parallel wrapper or sampler: `group` when given, else the world, except
/// while a ProcessMesh with tensor, pipeline or context ranks is alive: the world then spans those
/// too (the ranks of one tensor group would read different batches, or average different shards),
/// so leaving the group unset raises, naming mesh.data(). `op` names the caller in the error.
dist::Group data_parallel_group(const std::optional<dist::Group>& group, const char* op);
}  // namespace detail

}  // namespace weave::parallel
