#include "weave/parallel/core/mesh.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
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

// A rank's coordinate on each axis, indexed by Axis (tensor fastest), and its place among the
// experts: i = context + C data, expert i % E, expert replica i / E.
using Coordinates = std::array<int, 6>;

Coordinates coordinates_of(int rank, const MeshShape& s) {
  const int data = (rank / (s.tensor * s.context)) % s.data,
            context = (rank / s.tensor) % s.context;
  const int among = context + s.context * data;
  Coordinates at{};
  at[size_t(Axis::Data)] = data;
  at[size_t(Axis::Tensor)] = rank % s.tensor;
  at[size_t(Axis::Pipeline)] = rank / (s.tensor * s.context * s.data);
  at[size_t(Axis::Context)] = context;
  at[size_t(Axis::Expert)] = among % s.expert;
  at[size_t(Axis::ExpertData)] = among / s.expert;
  return at;
}

constexpr unsigned bit(Axis axis) {
  return 1u << static_cast<unsigned>(axis);
}
constexpr unsigned kExpertAxes = bit(Axis::Expert) | bit(Axis::ExpertData);
constexpr unsigned kDenseAxes = bit(Axis::Data) | bit(Axis::Context);

// The partition of the world into groups of ranks that differ only in the axes of `mask`: they
// agree on every other coordinate of the mask's basis (data, context, tensor, pipeline; or
// expert, expert replica, tensor, pipeline). Groups in rank order of their first member.
std::vector<std::vector<int>> partition(const MeshShape& s, int world, unsigned mask) {
  const bool experts = (mask & kExpertAxes) != 0;
  const std::vector<Axis> basis =
      experts ? std::vector<Axis>{Axis::Expert, Axis::ExpertData, Axis::Tensor, Axis::Pipeline}
              : std::vector<Axis>{Axis::Data, Axis::Context, Axis::Tensor, Axis::Pipeline};
  auto same = [&](int a, int b) {
    const Coordinates x = coordinates_of(a, s), y = coordinates_of(b, s);
    for (Axis axis : basis)
      if (!(mask & bit(axis)) && x[size_t(axis)] != y[size_t(axis)]) return false;
    return true;
  };
  std::vector<std::vector<int>> groups;
  std::vector<bool> placed(size_t(world), false);
  for (int r = 0; r < world; ++r) {
    if (placed[size_t(r)]) continue;
    groups.emplace_back();
    for (int q = r; q < world; ++q)
      if (!placed[size_t(q)] && same(r, q)) {
        placed[size_t(q)] = true;
        groups.back().push_back(q);
      }
  }
  return groups;
}

// The ranks of each pipeline stage and replica, tensor-major and then in their shard group's
// order (ascending rank): the pieces of a vocabulary split over tensor x shard.
dist::Group vocabulary_pieces(const MeshShape& shape, int world, int shards) {
  std::map<std::array<int, 2>, std::vector<std::pair<int, int>>> holders;
  for (int r = 0; r < world; ++r) {
    const Coordinates at = coordinates_of(r, shape);
    holders[{at[size_t(Axis::Pipeline)], at[size_t(Axis::Data)] / shards}].emplace_back(
        at[size_t(Axis::Tensor)], r);
  }
  std::vector<std::vector<int>> lists;
  for (auto& [key, members] : holders) {
    std::sort(members.begin(), members.end());
    lists.emplace_back();
    for (const auto& [tensor, rank] : members) lists.back().push_back(rank);
  }
  std::sort(lists.begin(), lists.end());
  return dist::split_group(dist::world(), lists);
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
  WEAVE_CHECK(shape.expert >= 1 && (shape.data * shape.context) % shape.expert == 0, "ProcessMesh",
              "expert={} must divide data={} x context={} = {}: experts are spread over a "
              "sub-axis of data x context; hint: choose an expert size dividing {}",
              shape.expert, shape.data, shape.context, shape.data * shape.context,
              shape.data * shape.context);
  // Every set of axes, in one order on every rank; a partition met before is not created again.
  std::map<std::vector<std::vector<int>>, dist::Group> created;
  for (unsigned mask = 1; mask < (1u << 6); ++mask) {
    if ((mask & kExpertAxes) && (mask & kDenseAxes)) continue;
    std::vector<std::vector<int>> groups = partition(shape, world, mask);
    auto found = created.find(groups);
    if (found == created.end())
      found = created
                  .emplace(groups,
                           groups_of(int(groups.size()), [&](int i) { return groups[size_t(i)]; }))
                  .first;
    groups_.emplace(mask, found->second);
  }
  WEAVE_CHECK(shape.replicate >= 1 && shape.data % shape.replicate == 0, "ProcessMesh",
              "replicate={} must divide data={}: HSDP splits the data axis into replicate x "
              "shard; hint: choose a replicate size dividing {}",
              shape.replicate, shape.data, shape.data);
  // HSDP's two sub-axes of data: shard index d % S, replica index d / S.
  const int shards = shape.data / shape.replicate;
  const auto sub_axis = [&](bool by_shard) {
    std::map<std::array<int, 4>, std::vector<int>> groups;  // by the coordinates that stay
    for (int r = 0; r < world; ++r) {
      const Coordinates at = coordinates_of(r, shape);
      const int d = at[size_t(Axis::Data)];
      groups[{at[size_t(Axis::Tensor)], at[size_t(Axis::Pipeline)],
              by_shard ? d / shards : d % shards, by_shard ? 0 : at[size_t(Axis::Context)]}]
          .push_back(r);
    }
    std::vector<std::vector<int>> lists;
    for (auto& [key, ranks] : groups) lists.push_back(std::move(ranks));
    std::sort(lists.begin(), lists.end());
    return dist::split_group(dist::world(), lists);
  };
  shard_ = shape.replicate > 1 ? sub_axis(true) : group({Axis::Data, Axis::Context});
  replicate_ = sub_axis(false);
  vocabulary_ = shape.tensor == 1 ? shard_ : vocabulary_pieces(shape, world, shards);
  tensor_ = group({Axis::Tensor});
  data_ = group({Axis::Data});
  pipeline_ = group({Axis::Pipeline});
  context_ = group({Axis::Context});
  if (shape.tensor * shape.pipeline * shape.context * shape.expert > 1) {
    registered_ = std::make_shared<const MeshShape>(shape);
    std::lock_guard lock(meshes_mutex);
    meshes.push_back(registered_);
  }
}

const dist::Group& ProcessMesh::group(std::initializer_list<Axis> axes) const {
  unsigned mask = 0;
  for (Axis axis : axes) mask |= bit(axis);
  WEAVE_CHECK(!((mask & kExpertAxes) && (mask & kDenseAxes)), "ProcessMesh",
              "a group over Expert or ExpertData and Data or Context mixes two ways of cutting "
              "data x context; hint: Expert and ExpertData together span data x context");
  WEAVE_CHECK(mask != 0, "ProcessMesh", "expected at least one axis, found none");
  return groups_.at(mask);
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
  // Every axis of more than one rank is named; data, tensor and pipeline always are.
  std::string sizes = fmt::format("mesh data={} tensor={} pipeline={}", shape_.data, shape_.tensor,
                                  shape_.pipeline);
  std::string groups =
      fmt::format("data {} tensor {} pipeline {}", data_.str(), tensor_.str(), pipeline_.str());
  auto add = [&](const char* axis, int size, const dist::Group& group) {
    if (size <= 1) return;
    sizes += fmt::format(" {}={}", axis, size);
    groups += fmt::format(" {} {}", axis, group.str());
  };
  add("context", shape_.context, context_);
  add("expert", shape_.expert, expert());
  if (shape_.replicate > 1) {
    sizes += fmt::format(" replicate={}", shape_.replicate);
    groups += fmt::format(" shard {} replicate {}", shard_.str(), replicate_.str());
  }
  return fmt::format("{}; rank {}: {}", sizes, dist::rank(), groups);
}

}  // namespace weave::parallel
