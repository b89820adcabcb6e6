#include "weave/parallel/mesh.h"

#include <fmt/format.h>

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

}  // namespace

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
