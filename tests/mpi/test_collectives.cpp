// Every collective x dtypes x shapes x groups (world, reversed, groups that skip ranks) x roots,
// checked against the result computed locally from every rank's known input.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <numeric>

#include "helpers.h"
#include "weave/distributed/distributed.h"
#include "weave/distributed/fingerprint.h"
#include "weave/weave.h"

using namespace weave;
using dist::Group;
using dist::ReduceOp;

namespace {

const std::vector<DType> kDtypes = {kFloat32, kFloat64, kBFloat16, kInt32, kInt64, kUInt8};
const std::vector<Shape> kShapes = {Shape{}, Shape{1}, Shape{2, 3}, Shape{8, 10}, Shape{99, 77}};

// Rank r's input: small integers (exact in every dtype), different per rank and element.
Tensor value(const Shape& shape, DType dtype, int r, int salt = 0) {
  std::vector<double> v(shape.numel());
  for (size_t i = 0; i < v.size(); ++i) v[i] = double((int64_t(i) + r * 7 + salt) % 5 + 1);
  return from_vector(v, Shape{int64_t(v.size())}).reshape(shape).to(dtype);
}

// [k * s0, s1, ...] ([k] for a 0-d shape).
Shape stacked(const Shape& s, int k) {
  Shape out = s.empty() ? Shape{1} : s;
  out[0] *= k;
  return out;
}

// World, reversed world, and groups that skip ranks or start with a non-zero rank.
const std::vector<Group>& groups() {
  static std::vector<Group> all = [] {
    const int n = dist::world_size();
    std::vector<int> up(n), down(n);
    std::iota(up.begin(), up.end(), 0);
    std::reverse_copy(up.begin(), up.end(), down.begin());
    std::vector<Group> g = {dist::world(), dist::new_group(down)};
    if (n >= 3) g.push_back(dist::new_group({2, 0}));
    if (n >= 4) {
      g.push_back(dist::new_group({1, 3}));
      g.push_back(dist::new_group({3, 0, 2}));
    }
    return g;
  }();
  return all;
}

bool same(const Tensor& got, const Tensor& expected) {
  if (got.shape() != expected.shape() || got.dtype() != expected.dtype()) return false;
  return allclose(got.to(kFloat64), expected.to(kFloat64), 1e-2, 1e-6);
}

std::string where(const Group& g, DType dtype, const Shape& shape, int root = -1) {
  return fmt::format("group {} {} {}{}", g.str(), dtype, shape,
                     root >= 0 ? fmt::format(" root {}", root) : "");
}

Tensor reduce_all(const Group& g, const Shape& shape, DType dtype, ReduceOp op) {
  Tensor acc;
  for (int r = 0; r < g.size(); ++r) {
    Tensor v = value(shape, kFloat64, g.global_rank(r));
    if (!acc.defined())
      acc = v;
    else if (op == ReduceOp::Sum || op == ReduceOp::Avg)
      acc = acc + v;
    else if (op == ReduceOp::Prod)
      acc = acc * v;
    else if (op == ReduceOp::Max)
      acc = maximum(acc, v);
    else
      acc = minimum(acc, v);
  }
  if (op == ReduceOp::Avg) acc = acc / double(g.size());
  return acc.to(dtype);
}

}  // namespace

TEST_SUITE("collectives") {
  TEST_CASE("ranks and groups") {
    const int n = dist::world_size(), me = dist::rank();
    CHECK(me >= 0);
    CHECK(me < n);
    CHECK(dist::local_rank() <= me);
    CHECK(dist::world().size() == n);
    CHECK(dist::world().rank() == me);
    for (const Group& g : groups()) {
      CHECK(g.contains(me) == (g.rank() >= 0));
      if (g.rank() >= 0) CHECK(g.global_rank(g.rank()) == me);
    }
    if (n >= 3) {
      const Group& skip = groups()[2];  // {2, 0}
      CHECK(skip.global_rank(0) == 2);
      CHECK(skip.rank() == (me == 2 ? 0 : me == 0 ? 1 : -1));
    }
  }

  TEST_CASE("all_reduce: every op, dtype, shape and group") {
    for (const Group& g : groups()) {
      if (g.rank() < 0) continue;
      for (DType dtype : kDtypes)
        for (const Shape& shape : kShapes)
          for (ReduceOp op :
               {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Prod, ReduceOp::Avg}) {
            if (op == ReduceOp::Avg && !is_floating(dtype)) continue;
            if (op == ReduceOp::Prod && (dtype == kUInt8 || dtype == kBFloat16))
              continue;  // overflow
            Tensor t = value(shape, dtype, dist::rank());
            dist::all_reduce(t, op, g);
            CHECK_MESSAGE(same(t, reduce_all(g, shape, dtype, op)), "op ", int(op), " ",
                          where(g, dtype, shape));
          }
      // out of place leaves the input alone
      Tensor in = value({4, 5}, kFloat32, dist::rank()), out = empty({4, 5});
      dist::all_reduce(in, out, ReduceOp::Sum, g);
      CHECK(same(in, value({4, 5}, kFloat32, dist::rank())));
      CHECK(same(out, reduce_all(g, {4, 5}, kFloat32, ReduceOp::Sum)));
    }
  }

  TEST_CASE("large all_reduce travels in pieces and lands whole") {
    // Past 4 MB the MPI backend reduces in pieces: an odd count puts values on every piece
    // boundary, in and out of place, for sum (float64: exact) and avg (float32, both paths).
    const int64_t n = (int64_t{5} << 20) / 4 + 3;  // 5 MB of float32 and 3 more elements
    const int size = dist::world_size(), me = dist::rank();
    Tensor index = arange(0, double(n), 1, {.dtype = kFloat64});
    Tensor mine = index * double(me + 1);
    Tensor expected_sum = index * double(size * (size + 1) / 2);
    Tensor sum = mine.clone();
    dist::all_reduce(sum);
    CHECK(allclose(sum, expected_sum, 0.0, 0.0));
    Tensor avg_in = mine.to(kFloat32), avg_out = empty({n});
    dist::all_reduce(avg_in, avg_out, ReduceOp::Avg);
    CHECK(same(avg_in, mine.to(kFloat32)));
    CHECK(allclose(avg_out, (expected_sum / double(size)).to(kFloat32), 1e-6, 1e-5));
  }

  TEST_CASE("float16 and bool travel and reduce") {
    Tensor h = value({3, 3}, kFloat16, dist::rank());
    dist::all_reduce(h);
    CHECK(same(h, reduce_all(dist::world(), {3, 3}, kFloat16, ReduceOp::Sum)));
    Tensor b = full({4}, dist::rank() == 0 ? 1 : 0, {.dtype = kBool});
    dist::all_reduce(b, ReduceOp::Max);
    CHECK(b.to_vector<bool>() == std::vector<bool>(4, true));
    dist::all_reduce(b = full({4}, dist::rank() == 0 ? 1 : 0, {.dtype = kBool}), ReduceOp::Min);
    CHECK(b.to_vector<bool>() == std::vector<bool>(4, dist::world_size() == 1));
  }

  TEST_CASE("broadcast and reduce from every root") {
    for (const Group& g : groups()) {
      if (g.rank() < 0) continue;
      for (DType dtype : kDtypes)
        for (const Shape& shape : kShapes)
          for (int root = 0; root < g.size(); ++root) {
            Tensor t = value(shape, dtype, dist::rank());
            dist::broadcast(t, root, g);
            CHECK_MESSAGE(same(t, value(shape, dtype, g.global_rank(root))), "broadcast ",
                          where(g, dtype, shape, root));
            Tensor r = value(shape, dtype, dist::rank());
            dist::reduce(r, ReduceOp::Sum, root, g);
            Tensor expected = g.rank() == root ? reduce_all(g, shape, dtype, ReduceOp::Sum)
                                               : value(shape, dtype, dist::rank());
            CHECK_MESSAGE(same(r, expected), "reduce ", where(g, dtype, shape, root));
          }
    }
  }

  TEST_CASE("all_gather, reduce_scatter, gather, scatter, all_to_all") {
    for (const Group& g : groups()) {
      if (g.rank() < 0) continue;
      const int n = g.size(), me = g.rank();
      for (DType dtype : kDtypes)
        for (const Shape& shape : kShapes) {
          std::vector<Tensor> parts;
          for (int r = 0; r < n; ++r)
            parts.push_back(value(shape, dtype, g.global_rank(r)).reshape(stacked(shape, 1)));
          Tensor gathered_expected = cat(parts, 0);

          Tensor out = empty(stacked(shape, n), {.dtype = dtype});
          dist::all_gather(out, value(shape, dtype, dist::rank()), g);
          CHECK_MESSAGE(same(out, gathered_expected), "all_gather ", where(g, dtype, shape));

          // reduce_scatter: every rank contributes [n * s0, ...]; rank r keeps slice r of the sum.
          Shape full_shape = stacked(shape, n);
          Tensor rs = empty(stacked(shape, 1), {.dtype = dtype});
          dist::reduce_scatter(rs, value(full_shape, dtype, dist::rank()), ReduceOp::Sum, g);
          Tensor sum = reduce_all(g, full_shape, kFloat64, ReduceOp::Sum);
          const int64_t rows = stacked(shape, 1)[0];
          CHECK_MESSAGE(same(rs, sum.narrow(0, me * rows, rows).to(dtype)), "reduce_scatter ",
                        where(g, dtype, shape));

          // all_to_all: slice j of rank r's input lands in slice r of rank j's output.
          Tensor a2a = empty(full_shape, {.dtype = dtype});
          dist::all_to_all(a2a, value(full_shape, dtype, dist::rank(), 3), g);
          std::vector<Tensor> pieces;
          for (int r = 0; r < n; ++r)
            pieces.push_back(
                value(full_shape, dtype, g.global_rank(r), 3).narrow(0, me * rows, rows));
          CHECK_MESSAGE(same(a2a, cat(pieces, 0)), "all_to_all ", where(g, dtype, shape));

          for (int root = 0; root < n; ++root) {
            Tensor gathered = me == root ? empty(stacked(shape, n), {.dtype = dtype}) : Tensor();
            dist::gather(gathered, value(shape, dtype, dist::rank()), root, g);
            if (me == root)
              CHECK_MESSAGE(same(gathered, gathered_expected), "gather ",
                            where(g, dtype, shape, root));
            Tensor piece = empty(stacked(shape, 1), {.dtype = dtype});
            Tensor source = me == root ? value(full_shape, dtype, dist::rank(), 1) : Tensor();
            dist::scatter(piece, source, root, g);
            Tensor root_input = value(full_shape, dtype, g.global_rank(root), 1);
            CHECK_MESSAGE(same(piece, root_input.narrow(0, me * rows, rows)), "scatter ",
                          where(g, dtype, shape, root));
          }
        }
    }
  }

  TEST_CASE("uneven all_gather and all_to_all") {
    for (const Group& g : groups()) {
      if (g.rank() < 0) continue;
      const int n = g.size(), me = g.rank();
      // rank r holds r + 1 rows of 3
      Tensor mine = value({me + 1, 3}, kInt64, dist::rank());
      Tensor all = dist::all_gather_uneven(mine, g);
      std::vector<Tensor> parts;
      for (int r = 0; r < n; ++r) parts.push_back(value({r + 1, 3}, kInt64, g.global_rank(r)));
      CHECK_MESSAGE(equal(all, cat(parts, 0)), "all_gather_uneven ", g.str());
      // rank r sends (r + j) % 3 rows to rank j
      std::vector<int64_t> send_splits, recv_splits;
      for (int j = 0; j < n; ++j) {
        send_splits.push_back((me + j) % 3);
        recv_splits.push_back((j + me) % 3);
      }
      auto total = [](const std::vector<int64_t>& v) {
        return std::accumulate(v.begin(), v.end(), int64_t{0});
      };
      Tensor input = value({total(send_splits), 2}, kFloat32, dist::rank());
      Tensor output = empty({total(recv_splits), 2});
      dist::all_to_all(output, input, recv_splits, send_splits, g);
      std::vector<Tensor> expected;
      for (int r = 0; r < n; ++r) {
        std::vector<int64_t> their;
        for (int j = 0; j < n; ++j) their.push_back((r + j) % 3);
        int64_t start = std::accumulate(their.begin(), their.begin() + me, int64_t{0});
        expected.push_back(
            value({total(their), 2}, kFloat32, g.global_rank(r)).narrow(0, start, their[me]));
      }
      CHECK_MESSAGE(equal(output, cat(expected, 0)), "all_to_all uneven ", g.str());
    }
  }

  TEST_CASE("send and recv around a ring") {
    const int n = dist::world_size(), me = dist::rank();
    if (n < 2) return;
    Tensor out = value({5, 4}, kFloat64, me), in = empty({5, 4}, {.dtype = kFloat64});
    const int next = (me + 1) % n, prev = (me + n - 1) % n;
    if (me % 2 == 0) {
      dist::send(out, next);
      dist::recv(in, prev);
    } else {
      dist::recv(in, prev);
      dist::send(out, next);
    }
    CHECK(equal(in, value({5, 4}, kFloat64, prev)));
    auto w1 = dist::send(out, next, dist::world(), 7, true);
    auto w2 = dist::recv(in.zero_(), prev, dist::world(), 7, true);
    w1.wait();
    w2.wait();
    CHECK(equal(in, value({5, 4}, kFloat64, prev)));
  }

  TEST_CASE("outstanding works complete in program order") {
    std::vector<Tensor> tensors;
    std::vector<dist::Work> works;
    for (int k = 0; k < 12; ++k) {
      tensors.push_back(value({64, 64}, kFloat32, dist::rank(), k));
      works.push_back(dist::all_reduce(tensors.back(), ReduceOp::Sum, dist::world(), true));
    }
    int violations = 0;
    for (int spin = 0; spin < 2000; ++spin) {  // sample completion states while they run
      for (size_t k = 1; k < works.size(); ++k)
        if (works[k].is_completed() && !works[k - 1].is_completed()) ++violations;
      if (works.back().is_completed()) break;
    }
    for (auto& w : works) w.wait();
    CHECK(violations == 0);
    for (int k = 0; k < 12; ++k) {
      Tensor expected = value({64, 64}, kFloat64, 0, k) * 0.0;
      for (int r = 0; r < dist::world_size(); ++r)
        expected = expected + value({64, 64}, kFloat64, r, k);
      CHECK(same(tensors[k], expected.to(kFloat32)));
    }
    // A blocking call after async ones waits its turn.
    Tensor t = full({3}, 1.0);
    dist::all_reduce(t);
    CHECK(t.to_vector<float>() == std::vector<float>(3, float(dist::world_size())));
  }

  // Strided views go through staging buffers. An asynchronous call must keep its stages (and
  // the views it lands in) alive after the caller drops every handle but the views' bases; a
  // blocking call queued behind them hands its stages by reference and must still find them
  // when the worker runs it.
  TEST_CASE("staged buffers outlive their callers: asynchronous and queued blocking calls") {
    const int n = dist::world_size(), me = dist::rank();
    std::vector<Tensor> exchanged, reduced;  // the bases of the views the calls land in
    std::vector<dist::Work> works;
    for (int k = 0; k < 4; ++k) {
      exchanged.push_back(zeros({6, 2 * n}));
      reduced.push_back(value({6, 2 * n}, kFloat32, me, k));
      // [2n, 6] views of [6, 2n] bases: strided, so both calls stage in and land back.
      works.push_back(dist::all_to_all(exchanged.back().transpose(0, 1),
                                       value({2 * n, 6}, kFloat32, me, k), dist::world(), true));
      works.push_back(
          dist::all_reduce(reduced.back().transpose(0, 1), ReduceOp::Sum, dist::world(), true));
    }
    Tensor blocking = zeros({5, 3});
    dist::all_reduce(blocking.transpose(0, 1).fill_(double(me + 1)));  // queued behind them
    CHECK(equal(blocking, full({5, 3}, n * (n + 1) / 2.0)));
    for (auto& w : works) w.wait();
    for (int k = 0; k < 4; ++k) {
      // Rank me receives rows [2 me, 2 me + 2) of every rank's input, in rank order.
      std::vector<Tensor> rows;
      Tensor sum = zeros({6, 2 * n});
      for (int j = 0; j < n; ++j) {
        rows.push_back(value({2 * n, 6}, kFloat32, j, k).narrow(0, 2 * me, 2));
        sum = sum + value({6, 2 * n}, kFloat32, j, k);
      }
      CHECK(equal(exchanged[k].transpose(0, 1), cat(rows, 0)));
      CHECK(equal(reduced[k], sum));
    }
  }

  TEST_CASE("broadcast_tensors and barrier") {
    Tensor a = value({3}, kFloat32, dist::rank()), b = value({2, 2}, kInt64, dist::rank());
    dist::broadcast_tensors({a, b}, 0);
    CHECK(equal(a, value({3}, kFloat32, 0)));
    CHECK(equal(b, value({2, 2}, kInt64, 0)));
    dist::barrier();
  }

  TEST_CASE("split_group: subgroups of a group, made by its members alone") {
    const int n = dist::world_size();
    if (n < 2) return;
    // The world's odd and even ranks, in descending order; then the evens split again by
    // halves, the odd ranks taking no part (new_group would need them).
    std::vector<int> odd, even;
    for (int r = n - 1; r >= 0; --r) (r % 2 ? odd : even).push_back(r);
    const Group parity = dist::split_group(dist::world(), {odd, even});
    const std::vector<int>& mine = dist::rank() % 2 ? odd : even;
    CHECK(parity.ranks() == mine);
    Tensor t = full({2}, double(dist::rank()), {.dtype = kFloat64});
    dist::all_reduce(t, ReduceOp::Sum, parity);
    double expected = 0;
    for (int r : mine) expected += r;
    CHECK(t.to_vector<double>() == std::vector<double>(2, expected));
    if (dist::rank() % 2 == 0 && even.size() >= 2) {
      const std::vector<int> first(even.begin(), even.begin() + 1),
          rest(even.begin() + 1, even.end());
      const Group part = dist::split_group(parity, {rest});  // the first even rank is left out
      const auto at = std::find(rest.begin(), rest.end(), dist::rank());
      CHECK(part.rank() == (at == rest.end() ? -1 : int(at - rest.begin())));
      if (part.rank() >= 0) {
        Tensor one = ones({1}, {.dtype = kFloat64});
        dist::all_reduce(one, ReduceOp::Sum, part);
        CHECK(one.item<double>() == double(rest.size()));
      }
      CHECK_WEAVE_ERROR(dist::split_group(parity, {first, first}), "split_group", "twice");
    }
    CHECK_WEAVE_ERROR(dist::split_group(dist::world(), {{n}}), "split_group", "is not in group");
  }

  TEST_CASE("the fingerprint tells the routes apart") {
    // Two ranks whose tensors take different routes (one through NCCL, one through MPI) would
    // call different libraries and wait forever: check mode must see them as different calls.
    using dist::detail::Fingerprint;
    Fingerprint host;
    host.op = static_cast<int32_t>(dist::detail::Op::Broadcast);
    host.dtype = static_cast<int32_t>(kFloat32);
    host.ndim = 1;
    host.dims[0] = 8;
    host.root = 0;
    host.wire = static_cast<int32_t>(DeviceType::CPU);
    Fingerprint device = host;
    device.rank = 1;
    device.wire = static_cast<int32_t>(DeviceType::CUDA);
    CHECK(dist::detail::same_call(host, host));
    CHECK_FALSE(dist::detail::same_call(host, device));
    CHECK(dist::detail::describe(host) == "broadcast(float32 [8], root 0) #0");
    CHECK(dist::detail::describe(device) == "broadcast(float32 [8], root 0, via NCCL) #0");
    // Ranks may differ in rank only.
    Fingerprint other_rank = host;
    other_rank.rank = 3;
    CHECK(dist::detail::same_call(host, other_rank));
  }

  TEST_CASE("a shape mismatch raises on every rank, naming what each called") {
    if (dist::world_size() < 2) return;
    Tensor t = dist::rank() == 1 ? zeros({3, 2}) : zeros({2, 3});
    std::string message;
    try {
      dist::all_reduce(t);
    } catch (const Error& e) {
      message = e.what();
    }
    CHECK(message.rfind("[all_reduce] collective mismatch", 0) == 0);
    CHECK(message.find("rank 0 called all_reduce(float32 [2, 3], sum)") != std::string::npos);
    CHECK(message.find("rank 1 called all_reduce(float32 [3, 2], sum)") != std::string::npos);
    // the group is still usable afterwards
    Tensor ok = ones({2});
    dist::all_reduce(ok);
    CHECK(ok.to_vector<float>() == std::vector<float>(2, float(dist::world_size())));
  }

  TEST_CASE("bad input is an error before anything is sent") {
    const int n = dist::world_size();
    auto expect = [](auto&& call, const char* op, const char* part) {
      std::string message;
      try {
        call();
      } catch (const Error& e) {
        message = e.what();
      }
      CHECK_MESSAGE(message.rfind(std::string("[") + op + "]", 0) == 0, message);
      CHECK_MESSAGE(message.find(part) != std::string::npos, message);
    };
    expect([&] { dist::broadcast(ones({2}), n); }, "broadcast", "outside group");
    expect([&] { dist::reduce(ones({2}), ReduceOp::Sum, -1); }, "reduce", "outside group");
    expect([&] { dist::all_reduce(ones({2}, {.dtype = kInt32}), ReduceOp::Avg); }, "all_reduce",
           "avg needs a floating");
    expect([&] { dist::all_reduce(ones({2}), zeros({3}), ReduceOp::Sum); }, "all_reduce",
           "differ in shape");
    expect([&] { dist::all_gather(empty({n + 1}), ones({1})); }, "all_gather", "expected");
    expect([&] { dist::all_to_all(empty({2}), ones({2}), {1}, {1}); }, "all_to_all", "splits");
    std::vector<int64_t> wrong(n, 0);
    wrong[0] = 5;
    expect([&] { dist::all_to_all(empty({5}), ones({4}), wrong, wrong); }, "all_to_all",
           "add up to 5");
    expect([&] { dist::send(ones({1}), dist::rank()); }, "send", "another rank");
    expect([&] { dist::new_group({0, 0}); }, "new_group", "twice");
    expect([&] { dist::new_group({n}); }, "new_group", "must lie in");
    if (n >= 3) {
      const Group& skip = groups()[2];  // {2, 0}: rank 1 is not a member
      if (skip.rank() < 0)
        expect([&] { dist::all_reduce(ones({1}), ReduceOp::Sum, skip); }, "all_reduce",
               "not in group");
    }
  }
}

// Point-to-point that holds on every backend, run again by CTest with sends that wait for their
// receive (WEAVE_MPI_SEND=synchronous, as NCCL's).
TEST_SUITE("point_to_point") {
  TEST_CASE("send_recv: a ring of grouped exchanges, blocking and not; a wrong receive raises") {
    // Every rank sends right and receives from the left at once: with sends that wait for their
    // receive (NCCL, WEAVE_MPI_SEND=synchronous) only a grouped exchange gets through.
    const int n = dist::world_size(), me = dist::rank();
    if (n < 2) return;
    const int next = (me + 1) % n, prev = (me + n - 1) % n;
    Tensor out = value({5, 4}, kFloat64, me), in = empty({5, 4}, {.dtype = kFloat64});
    dist::send_recv(out, next, in, prev);
    CHECK(equal(in, value({5, 4}, kFloat64, prev)));
    Tensor back = empty({5, 4}, {.dtype = kFloat64});
    dist::Work w = dist::send_recv(in, prev, back, next, dist::world(), 3, /*async_op=*/true);
    w.wait();
    CHECK(equal(back, value({5, 4}, kFloat64, me)));
    if (dist::check_mode() == dist::CheckMode::Off) return;
    // Rank 0 receives into a tensor of the wrong shape: it raises, naming both; the bytes sent
    // still cross, so the next exchange is clean.
    Tensor wrong = empty({me == 0 ? 3 : 5, 4}, {.dtype = kFloat64});
    const std::string error = test::error_of([&] { dist::send_recv(out, next, wrong, prev); });
    if (me == 0)
      CHECK_MESSAGE(error.find("sent float64 [5, 4], but this rank receives float64 [3, 4]") !=
                        std::string::npos,
                    error);
    else
      CHECK_MESSAGE(error.empty(), error);
    dist::send_recv(out, next, in.zero_(), prev);
    CHECK(equal(in, value({5, 4}, kFloat64, prev)));
  }
}

TEST_SUITE("point_to_point") {
  TEST_CASE("exchange: both neighbours at once, shapes and dtypes learned from the senders") {
    // Each rank sends a float64 [me + 1, 3] right and an int64 [2, me + 2] left and receives
    // from both sides in one call; at two ranks both go to the one peer, in the order given.
    const int n = dist::world_size(), me = dist::rank();
    if (n < 2) return;
    const int next = (me + 1) % n, prev = (me + n - 1) % n;
    auto right = [](int r) { return value({r + 1, 3}, kFloat64, 10 * r + 1); };
    auto left = [](int r) { return value({2, r + 2}, kInt64, 10 * r + 2); };
    for (int round = 0; round < 3; ++round) {  // the pairs stay in step from call to call
      const std::vector<Tensor> got =
          dist::exchange({right(me), left(me)}, {next, prev}, {prev, next});
      REQUIRE(got.size() == 2);
      CHECK(equal(got[0], right(prev)));
      CHECK(equal(got[1], left(next)));
    }
    // A rank with nothing to do in a round passes empty lists; its neighbours expect nothing.
    const bool idle = me == 0;
    std::vector<Tensor> sends;
    std::vector<int> to, from;
    if (!idle && next != 0) {
      sends.push_back(right(me));
      to.push_back(next);
    }
    if (prev != 0 && !idle) from.push_back(prev);
    const std::vector<Tensor> got = dist::exchange(sends, to, from);
    CHECK(got.size() == from.size());
    if (!from.empty()) CHECK(equal(got[0], right(prev)));
    // Bad arguments raise on the rank that passed them, before anything is sent.
    CHECK_THROWS_WITH_AS(dist::exchange({right(me)}, {}, {}),
                         doctest::Contains("one destination per tensor to send"), Error);
    CHECK_THROWS_WITH_AS(dist::exchange({right(me)}, {me}, {}),
                         doctest::Contains("must be another rank of group"), Error);
    CHECK_THROWS_WITH_AS(dist::exchange({}, {}, {n}), doctest::Contains("must be another rank"),
                         Error);
    dist::barrier();
  }
}
