// Differentiable exchanges with uneven splits (dist::functional::all_to_all with split sizes,
// send_recv): values and gradients against one process working on every rank's input (each
// rank's input is a known function of its rank), the distributed gradcheck, empty splits, and
// bad arguments raising on every rank with nothing sent.
#include <doctest/doctest.h>

#include <vector>

#include "helpers.h"
#include "weave/weave.h"

using namespace weave;
namespace F = weave::dist::functional;

namespace {

constexpr int64_t kWidth = 3;

// Rows rank r sends rank j: uneven, with empty splits at every size above one.
int64_t rows_sent(int r, int j) {
  return (r + 2 * j) % 3;
}

std::vector<int64_t> splits_of(int r, int n) {
  std::vector<int64_t> out;
  for (int j = 0; j < n; ++j) out.push_back(rows_sent(r, j));
  return out;
}

int64_t total(const std::vector<int64_t>& splits) {
  int64_t t = 0;
  for (int64_t s : splits) t += s;
  return t;
}

// Rank r's input and the weights of its loss: known to every rank, so one process can stack
// them.
Tensor input_of(int r, int64_t rows, int salt = 0) {
  Generator g(uint64_t(r) * 100 + uint64_t(salt) + 5);
  return randn({rows, kWidth}, {.dtype = kFloat64}, &g);
}

}  // namespace

TEST_SUITE("exchange") {
  TEST_CASE("uneven all_to_all equals one process on the stacked inputs, values and gradients") {
    const int n = dist::world_size(), me = dist::rank();
    // One process: every rank's input as a leaf, rank r's output the rows sent to it in rank
    // order; the objective is the sum over ranks of sum(y_r * w_r).
    std::vector<Tensor> xs;
    for (int r = 0; r < n; ++r) xs.push_back(input_of(r, total(splits_of(r, n))).requires_grad_());
    Tensor objective = zeros({}, {.dtype = kFloat64});
    Tensor expected;
    for (int r = 0; r < n; ++r) {
      std::vector<Tensor> pieces;
      for (int j = 0; j < n; ++j) {
        int64_t offset = 0;
        for (int k = 0; k < r; ++k) offset += rows_sent(j, k);
        pieces.push_back(xs[size_t(j)].narrow(0, offset, rows_sent(j, r)));
      }
      Tensor y = cat(pieces);
      Tensor w = input_of(r, y.size(0), 1);
      objective = objective + (y * w).sum();
      if (r == me) expected = y.detach();
    }
    objective.backward();

    Tensor x = input_of(me, total(splits_of(me, n))).requires_grad_();
    std::vector<int64_t> received;
    Tensor y = F::all_to_all(x, splits_of(me, n), dist::world(), &received);
    CHECK(test::close(y, expected, 1e-12, 0));
    for (int j = 0; j < n; ++j) CHECK(received[size_t(j)] == rows_sent(j, me));
    (y * input_of(me, y.size(0), 1)).sum().backward();
    CHECK(test::close(x.grad(), xs[size_t(me)].grad(), 1e-12, 0));
  }

  TEST_CASE("uneven all_to_all and send_recv pass the distributed gradcheck") {
    const int n = dist::world_size(), me = dist::rank();
    Tensor x = input_of(me, total(splits_of(me, n))).requires_grad_();
    auto exchanged = [&](const std::vector<Tensor>& in) {
      return tanh(F::all_to_all(in[0] * in[0], splits_of(me, n)));
    };
    int64_t rows = 0;  // over every rank: at one rank, rank 0 sends itself none
    for (int r = 0; r < n; ++r) rows += total(splits_of(r, n));
    if (rows == 0) {
      CHECK_THROWS_WITH_AS(dist::gradcheck(exchanged, {x}), doctest::Contains("nothing to check"),
                           Error);
    } else {
      auto uneven = dist::gradcheck(exchanged, {x});
      CHECK_MESSAGE(uneven.ok, uneven.report);
      CHECK(uneven.checked == rows * kWidth);
    }
    Tensor z = input_of(me, 2).requires_grad_();
    auto shift = dist::gradcheck(
        [&](const std::vector<Tensor>& in) {
          return F::send_recv(sin(in[0]), (me + 1) % n, (me + n - 1) % n) * in[0];
        },
        {z});
    CHECK_MESSAGE(shift.ok, shift.report);
    CHECK(shift.checked == 2 * kWidth * n);
  }

  TEST_CASE("send_recv shifts around a ring and back, values and gradients") {
    const int n = dist::world_size(), me = dist::rank();
    for (int step : {1, n - 1, n + 2}) {
      CAPTURE(step);
      const int to = (me + step) % n, from = ((me - step) % n + n) % n;
      Tensor x = input_of(me, 2).requires_grad_();
      Tensor y = F::send_recv(x, to, from);
      CHECK(test::close(y, input_of(from, 2), 1e-15, 0));
      // L = sum_r sum(y_r * w_r): the gradient of x_me is the weight of the rank it went to.
      (y * input_of(me, 2, 1)).sum().backward();
      CHECK(test::close(x.grad(), input_of(to, 2, 1), 1e-15, 0));
    }
  }

  TEST_CASE("with both splits known, the reverse exchange returns every row home") {
    const int n = dist::world_size(), me = dist::rank();
    Tensor x = input_of(me, total(splits_of(me, n))).requires_grad_();
    std::vector<int64_t> received;
    const Tensor y = F::all_to_all(x, splits_of(me, n), dist::world(), &received);
    // Rows come back where they started; the gradient of sum(back * w) is w on x.
    const Tensor back = F::all_to_all(y * 2.0, received, splits_of(me, n));
    CHECK(test::close(back, x.detach() * 2.0, 1e-15, 0));
    const Tensor w = input_of(me, x.size(0), 3);
    (back * w).sum().backward();
    CHECK(test::close(x.grad(), w * 2.0, 1e-15, 0));
    // A 0-d tensor on rank 0 only: every rank raises, and the group stays in step.
    const Tensor bad = me == 0 ? full({}, 1.0, {.dtype = kFloat64}) : x.detach();
    CHECK_WEAVE_ERROR(F::all_to_all(bad, splits_of(me, n), received), "all_to_all",
                      me == 0 || n == 1 ? "at least 1 dimension" : "rejected its arguments");
    CHECK(F::all_to_all(x.detach(), splits_of(me, n)).size(0) == total(received));
  }

  TEST_CASE("empty exchanges: a rank that sends nothing and receives nothing") {
    const int n = dist::world_size(), me = dist::rank();
    std::vector<int64_t> nothing(size_t(n), 0);
    Tensor x = zeros({0, kWidth}, {.dtype = kFloat64}).requires_grad_();
    std::vector<int64_t> received;
    Tensor y = F::all_to_all(x, nothing, dist::world(), &received);
    CHECK(y.shape() == Shape{0, kWidth});
    CHECK(received == nothing);
    y.sum().backward();
    CHECK(x.grad().shape() == Shape{0, kWidth});
    Tensor e = F::send_recv(zeros({0}, {.dtype = kFloat64}), (me + 1) % n, (me + n - 1) % n);
    CHECK(e.numel() == 0);
  }

  TEST_CASE("bad splits or pairings raise on every rank, and nothing is left in flight") {
    const int n = dist::world_size(), me = dist::rank();
    const std::vector<int64_t> good = splits_of(me, n);
    Tensor x = input_of(me, total(good));
    // Rank 0's split sizes do not add up; the others' do.
    std::vector<int64_t> off = good;
    if (me == 0) off[0] += 1;
    CHECK_WEAVE_ERROR(F::all_to_all(x, off), "all_to_all",
                      me == 0 ? "add up to" : (n == 1 ? "add up to" : "rejected its arguments"));
    // One split size per rank.
    CHECK_WEAVE_ERROR(F::all_to_all(x, std::vector<int64_t>(size_t(n + 1), 0)), "all_to_all",
                      "one split size per rank");
    if (n > 1) {
      // Every rank sends to rank 0 and expects its left neighbour: rank 0 receives from all.
      const Tensor same = input_of(me, 2);
      CHECK_WEAVE_ERROR(F::send_recv(same, 0, (me + n - 1) % n), "send_recv", "expects to receive");
      // Rows of different widths.
      CHECK_WEAVE_ERROR(
          F::all_to_all(input_of(me, total(good)).narrow(1, 0, me == 1 ? 2 : 3), good),
          "all_to_all", "different dtypes or row shapes");
      // Rank 0 names a rank outside the group.
      CHECK_WEAVE_ERROR(F::send_recv(same, me == 0 ? n : (me + 1) % n, (me + n - 1) % n),
                        "send_recv", me == 0 ? "must be ranks of group" : "rejected its arguments");
      // Shapes differ: rank 1's tensor has one row more.
      CHECK_WEAVE_ERROR(F::send_recv(input_of(me, me == 1 ? 3 : 2), (me + 1) % n, (me + n - 1) % n),
                        "send_recv", "different dtypes or shapes");
    }
    // The group is still in step: a good exchange goes through.
    Tensor y = F::all_to_all(x, good);
    CHECK(y.size(0) == [&] {
      int64_t rows = 0;
      for (int j = 0; j < n; ++j) rows += rows_sent(j, me);
      return rows;
    }());
  }
}
