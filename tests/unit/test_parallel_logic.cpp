// The parallel module's local logic, without communication: how a saved piece's elements map
// to runs of the global tensor (against an element-by-element brute force over random pieces),
// and how parameters are cut into gradient buckets (hand-worked cases).
#include <doctest/doctest.h>

#include <map>
#include <random>
#include <vector>

#include "helpers.h"
#include "weave/parallel/checkpoint/reshard.h"
#include "weave/parallel/checkpoint/saved_pieces.h"
#include "weave/parallel/core/flat_buffer.h"
#include "weave/parallel/core/readiness.h"

using namespace weave;
using parallel::detail::Piece;

namespace {

// Box element e (row-major over the box) -> its row-major index in the global tensor, one
// coordinate at a time.
int64_t global_index(const Piece& piece, int64_t e) {
  std::vector<int64_t> box(piece.shape.vec());
  if (piece.axis >= 0) box[size_t(piece.axis)] = piece.length;
  std::vector<int64_t> coordinate(box.size());
  for (size_t d = box.size(); d-- > 0;) {
    coordinate[d] = e % box[d];
    e /= box[d];
  }
  if (piece.axis >= 0) coordinate[size_t(piece.axis)] += piece.begin;
  int64_t global = 0;
  for (size_t d = 0; d < box.size(); ++d) global = global * piece.shape[int(d)] + coordinate[d];
  return global;
}

// A random piece of a tensor of `shape`: a random box (cut along a random axis, or whole), a
// random range of its elements, stored from a random offset on.
template <class Pick>
Piece random_piece(const Shape& shape, Pick&& pick) {
  Piece piece;
  piece.shape = shape;
  const int dims = int(shape.size());
  piece.axis = int(pick(-1, dims - 1));
  int64_t box = shape.numel();
  if (piece.axis >= 0) {
    const int64_t size = shape[piece.axis];
    piece.begin = pick(0, size - 1);
    piece.length = pick(1, size - piece.begin);
    box = box / size * piece.length;
  }
  piece.first = pick(0, box);
  piece.count = pick(0, box - piece.first);
  piece.offset = pick(0, 7);
  return piece;
}

}  // namespace

TEST_SUITE("parallel_logic") {
  TEST_CASE("runs_of maps every element of 2000 random pieces where the brute force does") {
    std::mt19937 rng(35);
    auto pick = [&](int64_t lo, int64_t hi) {  // in [lo, hi]
      return lo + int64_t(rng() % uint64_t(hi - lo + 1));
    };
    for (int trial = 0; trial < 2000; ++trial) {
      Shape shape;
      const int dims = int(pick(1, 4));
      for (int d = 0; d < dims; ++d) shape.push_back(pick(1, 5));
      const Piece piece = random_piece(shape, pick);
      CAPTURE(trial);
      std::map<int64_t, int64_t> got;  // local element -> global element
      int64_t covered = 0, last_local = -1;
      for (const parallel::detail::Run& run : parallel::detail::runs_of(piece)) {
        CHECK(run.count > 0);
        CHECK(run.local > last_local);  // in order, not overlapping
        last_local = run.local + run.count - 1;
        for (int64_t j = 0; j < run.count; ++j) got[run.local + j] = run.global + j;
        covered += run.count;
      }
      CHECK(covered == piece.count);
      std::map<int64_t, int64_t> want;
      for (int64_t e = piece.first; e < piece.first + piece.count; ++e)
        want[piece.offset + e - piece.first] = global_index(piece, e);
      CHECK(got == want);
    }
  }

  TEST_CASE("plan_tensor reads each wanted element from the first saved piece holding it") {
    // Against a brute force over 2000 random cases: a wanted piece and 1 to 4 saved pieces of
    // one global tensor, in order of preference.
    std::mt19937 rng(36);
    auto pick = [&](int64_t lo, int64_t hi) { return lo + int64_t(rng() % uint64_t(hi - lo + 1)); };
    int64_t planned = 0, missing_total = 0;
    for (int trial = 0; trial < 2000; ++trial) {
      Shape shape;
      const int dims = int(pick(1, 3));
      for (int d = 0; d < dims; ++d) shape.push_back(pick(1, 5));
      const Piece want = random_piece(shape, pick);
      std::vector<std::vector<parallel::detail::Run>> sources;
      // global element -> (source, its stored element), the first source holding it
      std::map<int64_t, std::pair<size_t, int64_t>> holder;
      const int saved = int(pick(1, 4));
      for (int k = 0; k < saved; ++k) {
        const Piece piece = random_piece(shape, pick);
        for (int64_t e = piece.first; e < piece.first + piece.count; ++e)
          holder.try_emplace(global_index(piece, e),
                             std::make_pair(size_t(k), piece.offset + e - piece.first));
        sources.push_back(parallel::detail::runs_of(piece));
      }
      CAPTURE(trial);
      const parallel::detail::TensorPlan plan = parallel::detail::plan_tensor(want, sources);
      // Every wanted element (by its stored index in the target) is read once or missing once.
      std::map<int64_t, std::pair<size_t, int64_t>> read;  // target element -> source, element
      for (const auto& r : plan.reads) {
        CHECK(r.count > 0);
        for (int64_t j = 0; j < r.count; ++j)
          CHECK(read.emplace(r.local + j, std::make_pair(r.source, r.source_element + j)).second);
      }
      std::map<int64_t, int64_t> missing;  // target element -> global element
      for (const auto& run : plan.missing)
        for (int64_t j = 0; j < run.count; ++j) missing[run.local + j] = run.global + j;
      std::map<int64_t, std::pair<size_t, int64_t>> want_read;
      std::map<int64_t, int64_t> want_missing;
      for (int64_t e = want.first; e < want.first + want.count; ++e) {
        const int64_t local = want.offset + e - want.first, global = global_index(want, e);
        auto it = holder.find(global);
        if (it == holder.end())
          want_missing[local] = global;
        else
          want_read[local] = it->second;
      }
      CHECK(read == want_read);
      CHECK(missing == want_missing);
      planned += int64_t(read.size());
      missing_total += int64_t(missing.size());
    }
    // Both outcomes occur often enough to matter.
    CHECK(planned > 1000);
    CHECK(missing_total > 1000);
  }

  TEST_CASE("cut_buckets: caps in bytes, the first bucket's own cap, a dtype change cuts") {
    const double byte = 1.0 / (1024 * 1024);  // megabytes per byte
    const std::vector<Tensor> params = {zeros({100}), zeros({200}),
                                        zeros({300})};  // 400, 800, 1200 B
    // Backward order 2, 1, 0. The first bucket (cap 1000 B) takes parameter 2 alone, which is
    // over any cap; parameter 1 does not fit beside it; the next bucket (cap 1500 B) holds 1 and 0.
    using Buckets = std::vector<std::vector<int>>;
    CHECK(parallel::detail::cut_buckets({2, 1, 0}, params, 1000 * byte, 1500 * byte) ==
          Buckets{{2}, {1, 0}});
    CHECK(parallel::detail::cut_buckets({2, 1, 0}, params, 1000 * byte, 1000 * byte) ==
          Buckets{{2}, {1}, {0}});
    CHECK(parallel::detail::cut_buckets({0, 1, 2}, params, 25, 25) == Buckets{{0, 1, 2}});
    const std::vector<Tensor> mixed = {zeros({10}), zeros({10}, {.dtype = kFloat64}),
                                       zeros({10}, {.dtype = kFloat64}), zeros({10})};
    CHECK(parallel::detail::cut_buckets({0, 1, 2, 3}, mixed, 25, 25) == Buckets{{0}, {1, 2}, {3}});
    CHECK(parallel::detail::cut_buckets({}, params, 1, 1).empty());
    CHECK_WEAVE_ERROR(parallel::detail::check_bucket_sizes("test", 1, 0), "test",
                      "bucket sizes must be positive");
  }

  TEST_CASE("GradReadiness: the traced order, buckets launched in order, held back, failed") {
    std::vector<Tensor> params;
    for (int i = 0; i < 4; ++i) params.push_back(full({2}, double(i + 1)).requires_grad_());
    // Used in order 0..3: the engine replays the forward in reverse, so 3 is ready first.
    auto loss = [&] {
      Tensor total = sum(params[0] * params[0]);
      for (int i = 1; i < 4; ++i) total = total + sum(params[size_t(i)] * params[size_t(i)]);
      return total;
    };
    std::vector<int> launched, finished;
    auto readiness = parallel::detail::GradReadiness::create(
        params, {.ready = {},
                 .launch = [&](int b) { launched.push_back(b); },
                 .finish = [&](bool failed) { finished.push_back(failed ? 1 : 0); }});
    loss().backward();  // no buckets yet: the first backward traces
    CHECK(readiness->take_trace() == std::vector<int>{3, 2, 1, 0});
    CHECK(launched.empty());
    CHECK(finished == std::vector<int>{0});
    readiness->set_buckets({{3, 2}, {1, 0}});
    loss().backward();
    CHECK(launched == std::vector<int>{0, 1});
    CHECK(finished == std::vector<int>{0, 0});
    // The last bucket held back: only launch_rest() launches it.
    launched.clear();
    readiness->set_buckets({{3, 2}, {1, 0}}, /*held_back=*/1);
    loss().backward();
    CHECK(launched == std::vector<int>{0});
    readiness->launch_rest();
    CHECK(launched == std::vector<int>{0, 1});
    // Paused (no_sync): the hooks do nothing.
    launched.clear();
    readiness->set_buckets({{3, 2}, {1, 0}});
    readiness->set_paused(true);
    loss().backward();
    readiness->set_paused(false);
    CHECK(launched.empty());
    // A backward that raises part-way still finishes, as failed; only the complete bucket went.
    finished.clear();
    HookHandle hook = params[1].register_hook([](const Tensor&) -> Tensor {
      throw Error("[test] parameter 1's hook failed on purpose");
    });
    CHECK_THROWS_AS(loss().backward(), Error);
    hook.remove();
    CHECK(launched == std::vector<int>{0});
    CHECK(finished == std::vector<int>{1});
  }

  TEST_CASE("add_shard_to_groups: each member's part of a shard in its group, padding in none") {
    // Members of 3, 5 and 2 elements at offsets 0, 3, 8, padded to 12 for 4 ranks of 3.
    const auto flat =
        parallel::detail::FlatBuffer::like({zeros({3}), zeros({5}), zeros({2})}, /*pad_to=*/4);
    REQUIRE(flat.offsets == std::vector<int64_t>{0, 3, 8});
    const std::vector<int> group_of = {0, 1, 0};  // the middle member in group 1
    auto parts = [&](int rank) {
      std::vector<optim::ParamGroup> groups(2);
      Tensor shard = zeros({3});
      flat.add_shard_to_groups(groups, shard, 3 * rank, group_of);
      std::vector<std::vector<std::pair<int64_t, int64_t>>> out(2);
      for (size_t g = 0; g < 2; ++g) {
        REQUIRE(groups[g].params.size() == groups[g].ranges.size());
        for (const optim::ElementRange& r : groups[g].ranges) out[g].push_back({r.begin, r.end});
      }
      return out;
    };
    using Parts = std::vector<std::vector<std::pair<int64_t, int64_t>>>;
    CHECK(parts(0) == Parts{{{0, 3}}, {}});        // elements 0-2: member 0
    CHECK(parts(1) == Parts{{}, {{0, 3}}});        // 3-5: member 1
    CHECK(parts(2) == Parts{{{2, 3}}, {{0, 2}}});  // 6-7: member 1, 8: member 2
    CHECK(parts(3) == Parts{{{0, 1}}, {}});        // 9: member 2, 10-11: padding
    const auto lone = parallel::detail::FlatBuffer::like({zeros({2})}, /*pad_to=*/4);
    std::vector<optim::ParamGroup> groups(2);
    lone.add_shard_to_groups(groups, zeros({2}), 2, {1});  // padding alone
    REQUIRE(groups[0].ranges.size() == 1);
    CHECK(groups[0].ranges[0].begin == groups[0].ranges[0].end);
    CHECK(groups[1].params.empty());
  }
}
