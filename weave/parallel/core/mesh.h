#pragma once
// Process meshes: a world of data x tensor x pipeline ranks, with one group of each kind per
// rank (Megatron's layout: tensor-parallel ranks adjacent, then data, then pipeline).
//
//   parallel::ProcessMesh mesh({.data = 2, .tensor = 2});   // 4 ranks
//   parallel::ColumnParallelLinear fc(784, 256, mesh.tensor());
//   parallel::DistributedDataParallel ddp(model, {.group = mesh.data()});
//
// Rank r sits at tensor index r % T, data index (r / T) % D, pipeline index r / (T * D).
// Every rank must construct the mesh (it creates groups, a collective step).
#include <memory>
#include <optional>
#include <string>

#include "weave/distributed/distributed.h"

namespace weave::parallel {

struct MeshShape {
  int data = 1;
  int tensor = 1;
  int pipeline = 1;
};

class ProcessMesh {
 public:
  /// Splits the world; data * tensor * pipeline must equal the world size.
  explicit ProcessMesh(MeshShape shape);

  const MeshShape& shape() const { return shape_; }
  /// This rank's groups: the ranks that differ from it only in that coordinate.
  const dist::Group& data() const { return data_; }
  const dist::Group& tensor() const { return tensor_; }
  const dist::Group& pipeline() const { return pipeline_; }
  /// This rank's coordinates.
  int data_rank() const { return data_.rank(); }
  int tensor_rank() const { return tensor_.rank(); }
  int pipeline_rank() const { return pipeline_.rank(); }
  /// The global rank at the given coordinates.
  int rank_at(int data, int tensor, int pipeline) const;
  /// "mesh data=2 tensor=2 pipeline=1; rank 3: data [1, 3] tensor [2, 3] pipeline [3]".
  std::string str() const;

 private:
  MeshShape shape_;
  dist::Group data_, tensor_, pipeline_;
  std::shared_ptr<const MeshShape> registered_;  // alive while a copy of this mesh is
};

namespace detail {
/// The group of a data-parallel wrapper or sampler: `group` when given, else the world, except
/// while a ProcessMesh with tensor or pipeline ranks is alive: the world then spans those too
/// (the ranks of one tensor group would read different batches, or average different shards),
/// so leaving the group unset raises, naming mesh.data(). `op` names the caller in the error.
dist::Group data_parallel_group(const std::optional<dist::Group>& group, const char* op);
}  // namespace detail

}  // namespace weave::parallel
