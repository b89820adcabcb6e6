#include "weave/parallel/core/mesh.h"

#include <fmt/format.h>

#include <mutex>
#include <vector>

namespace weave::parallel {

namespace {

// Creates every group of one kind (all ranks take part in each creation) and keeps this rank's.
template <class RanksOf>
dist::Group groups_of(int count, RanksOf ranks_of) {
  dist::Group mine = dist::world();
  for (int i = 0; i < count; ++i) {
    dist::Group g = dist::new_group(ranks_of(i));
    if (g.rank() >= 0) mine = g;
  }
  return mine;
}

std::mutex meshes_mutex;
std::vector<std::weak_ptr<const MeshShape>> meshes;  // alive meshes beyond data parallelism

}  // namespace

namespace detail {
dist::Group data_parallel_group(const std::optional<dist::Group>& group, const char* op) {
  if (group) return *group;
  std::lock_guard lock(meshes_mutex);
  std::erase_if(meshes, [](const auto& weak) { return weak.expired(); });
  if (!meshes.empty()) {
    const MeshShape shape = *meshes.front().lock();
    WEAVE_FAIL(op,
               "no group was given, and a ProcessMesh (data={} tensor={} pipeline={}) exists, so "
               "the default (the world) would span its tensor and pipeline ranks too: the ranks "
               "of one tensor group would read different batches or average different shards; "
               "hint: pass the mesh's data group (mesh.data()), or dist::world() if the whole "
               "world is meant",
               shape.data, shape.tensor, shape.pipeline);
  }
  return dist::world();
}
}  // namespace detail

ProcessMesh::ProcessMesh(MeshShape shape) : shape_(shape) {
  const int world = dist::world_size();
  WEAVE_CHECK(shape.data >= 1 && shape.tensor >= 1 && shape.pipeline >= 1, "ProcessMesh",
              "sizes must be positive, found data={} tensor={} pipeline={}", shape.data,
              shape.tensor, shape.pipeline);
  WEAVE_CHECK(int64_t{shape.data} * shape.tensor * shape.pipeline == world, "ProcessMesh",
              "data={} x tensor={} x pipeline={} is {} ranks, but the world has {}; hint: launch "
              "with mpirun -np {} or change the mesh",
              shape.data, shape.tensor, shape.pipeline,
              int64_t{shape.data} * shape.tensor * shape.pipeline, world,
              int64_t{shape.data} * shape.tensor * shape.pipeline);
  const int D = shape.data, T = shape.tensor, P = shape.pipeline;
  // each group kind: one group per combination of the other two coordinates
  tensor_ = groups_of(D * P, [&](int i) {
    std::vector<int> ranks;
    for (int t = 0; t < T; ++t) ranks.push_back(rank_at(i % D, t, i / D));
    return ranks;
  });
  data_ = groups_of(T * P, [&](int i) {
    std::vector<int> ranks;
    for (int d = 0; d < D; ++d) ranks.push_back(rank_at(d, i % T, i / T));
    return ranks;
  });
  pipeline_ = groups_of(D * T, [&](int i) {
    std::vector<int> ranks;
    for (int p = 0; p < P; ++p) ranks.push_back(rank_at(i % D, i / D, p));
    return ranks;
  });
  if (T * P > 1) {
    registered_ = std::make_shared<const MeshShape>(shape);
    std::lock_guard lock(meshes_mutex);
    meshes.push_back(registered_);
  }
}

int ProcessMesh::rank_at(int data, int tensor, int pipeline) const {
  WEAVE_CHECK(data >= 0 && data < shape_.data && tensor >= 0 && tensor < shape_.tensor &&
                  pipeline >= 0 && pipeline < shape_.pipeline,
              "ProcessMesh",
              "coordinates (data={}, tensor={}, pipeline={}) are outside the mesh {}", data, tensor,
              pipeline, str());
  return tensor + shape_.tensor * (data + shape_.data * pipeline);
}

std::string ProcessMesh::str() const {
  return fmt::format("mesh data={} tensor={} pipeline={}; rank {}: data {} tensor {} pipeline {}",
                     shape_.data, shape_.tensor, shape_.pipeline, dist::rank(), data_.str(),
                     tensor_.str(), pipeline_.str());
}

}  // namespace weave::parallel
