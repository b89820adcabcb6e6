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
               "no group was given, and a ProcessMesh (data={} tensor={} pipeline={} context={}) "
               "exists, so the default (the world) would span its tensor, pipeline and context "
               "ranks too: the ranks of one tensor group would read different batches or average "
               "different shards; hint: pass the mesh's data group (mesh.data(), or "
               "mesh.data_and_context() under context parallelism), or dist::world() if the "
               "whole world is meant",
               shape.data, shape.tensor, shape.pipeline, shape.context);
  }
  return dist::world();
}
}  // namespace detail

namespace {

// A rank's coordinates, in the order of MeshShape's fields' significance (tensor fastest).
struct Coordinates {
  int data, tensor, pipeline, context;
};

Coordinates coordinates_of(int rank, const MeshShape& s) {
  return {(rank / (s.tensor * s.context)) % s.data, rank % s.tensor,
          rank / (s.tensor * s.context * s.data), (rank / s.tensor) % s.context};
}

// This rank's group of the ranks that share every coordinate `same` keeps equal. Every rank
// creates every such group, in rank order of their first member.
dist::Group group_where(const MeshShape& s, int world,
                        bool (*same)(const Coordinates&, const Coordinates&)) {
  std::vector<std::vector<int>> groups;
  std::vector<int> group_of(size_t(world), -1);
  for (int r = 0; r < world; ++r) {
    if (group_of[size_t(r)] >= 0) continue;
    groups.emplace_back();
    for (int q = r; q < world; ++q)
      if (group_of[size_t(q)] < 0 && same(coordinates_of(r, s), coordinates_of(q, s))) {
        group_of[size_t(q)] = int(groups.size()) - 1;
        groups.back().push_back(q);
      }
  }
  return groups_of(int(groups.size()), [&](int i) { return groups[size_t(i)]; });
}

}  // namespace

ProcessMesh::ProcessMesh(MeshShape shape) : shape_(shape) {
  const int world = dist::world_size();
  WEAVE_CHECK(shape.data >= 1 && shape.tensor >= 1 && shape.pipeline >= 1 && shape.context >= 1,
              "ProcessMesh",
              "sizes must be positive, found data={} tensor={} pipeline={} context={}", shape.data,
              shape.tensor, shape.pipeline, shape.context);
  const int64_t size = int64_t{shape.data} * shape.tensor * shape.pipeline * shape.context;
  WEAVE_CHECK(size == world, "ProcessMesh",
              "data={} x tensor={} x pipeline={} x context={} is {} ranks, but the world has {}; "
              "hint: launch with mpirun -np {} or change the mesh",
              shape.data, shape.tensor, shape.pipeline, shape.context, size, world, size);
  using C = const Coordinates&;
  tensor_ = group_where(shape, world, [](C a, C b) {
    return a.data == b.data && a.pipeline == b.pipeline && a.context == b.context;
  });
  data_ = group_where(shape, world, [](C a, C b) {
    return a.tensor == b.tensor && a.pipeline == b.pipeline && a.context == b.context;
  });
  pipeline_ = group_where(shape, world, [](C a, C b) {
    return a.data == b.data && a.tensor == b.tensor && a.context == b.context;
  });
  context_ = group_where(shape, world, [](C a, C b) {
    return a.data == b.data && a.tensor == b.tensor && a.pipeline == b.pipeline;
  });
  data_and_context_ = group_where(
      shape, world, [](C a, C b) { return a.tensor == b.tensor && a.pipeline == b.pipeline; });
  if (shape.tensor * shape.pipeline * shape.context > 1) {
    registered_ = std::make_shared<const MeshShape>(shape);
    std::lock_guard lock(meshes_mutex);
    meshes.push_back(registered_);
  }
}

int ProcessMesh::rank_at(int data, int tensor, int pipeline, int context) const {
  WEAVE_CHECK(data >= 0 && data < shape_.data && tensor >= 0 && tensor < shape_.tensor &&
                  pipeline >= 0 && pipeline < shape_.pipeline && context >= 0 &&
                  context < shape_.context,
              "ProcessMesh",
              "coordinates (data={}, tensor={}, pipeline={}, context={}) are outside the mesh {}",
              data, tensor, pipeline, context, str());
  return tensor + shape_.tensor * (context + shape_.context * (data + shape_.data * pipeline));
}

std::string ProcessMesh::str() const {
  if (shape_.context > 1)
    return fmt::format(
        "mesh data={} tensor={} pipeline={} context={}; rank {}: data {} tensor {} pipeline {} "
        "context {}",
        shape_.data, shape_.tensor, shape_.pipeline, shape_.context, dist::rank(), data_.str(),
        tensor_.str(), pipeline_.str(), context_.str());
  return fmt::format("mesh data={} tensor={} pipeline={}; rank {}: data {} tensor {} pipeline {}",
                     shape_.data, shape_.tensor, shape_.pipeline, dist::rank(), data_.str(),
                     tensor_.str(), pipeline_.str());
}

}  // namespace weave::parallel
