// Differentiable exchanges with uneven splits: all_to_all with per-rank split sizes, and
// send_recv (every rank's tensor shifted to another rank, JAX's ppermute). Both run on the
// uneven dist::all_to_all after one agreement on every rank's plan (dist::agree_max), which
// every rank checks alike: a bad argument on one rank raises on every rank before any data moves.
#include <limits>
#include <numeric>
#include <optional>
#include <span>
#include <string>

#include "weave/distributed/functional.h"
#include "weave/distributed/functional_support.h"
#include "weave/distributed/runtime.h"
#include "weave/ops/ops.h"

namespace weave::dist::functional {

namespace detail {

namespace {

// What a rank tells the others before an exchange.
struct Plan {
  std::optional<std::string> error;  // this rank's own arguments are bad
  std::vector<int64_t> splits;       // rows this rank sends to each rank
  int64_t expected_from = -1;        // send_recv: the one rank this rank receives from
  DType dtype = kFloat32;
  Shape signature;  // what must agree across ranks: the trailing dims (or the whole shape)
};

constexpr int64_t kHeader = 4 + kMaxDims;  // ok, expected_from, dtype, dims, the dims

// Every rank's plan as one row of words: the header, then its splits.
std::vector<std::vector<int64_t>> gather_plans(const Plan& mine, const Group& g) {
  const int n = g.size();
  const int64_t width = kHeader + n;
  std::vector<int64_t> words(size_t(width), 0);
  words[0] = mine.error ? 0 : 1;
  words[1] = mine.expected_from;
  words[2] = static_cast<int64_t>(mine.dtype);
  words[3] = mine.signature.size();
  for (int d = 0; d < mine.signature.size(); ++d) words[size_t(4 + d)] = mine.signature[d];
  if (!mine.error)
    for (int j = 0; j < n; ++j) words[size_t(kHeader + j)] = mine.splits[size_t(j)];
  // Every rank fills its own row, the lowest word elsewhere: the maximum is every rank's row.
  std::vector<int64_t> flat(size_t(width * n), std::numeric_limits<int64_t>::min());
  std::copy(words.begin(), words.end(), flat.begin() + g.rank() * width);
  agree_max(std::span<int64_t>(flat), g);
  std::vector<std::vector<int64_t>> rows;
  for (int r = 0; r < n; ++r)
    rows.emplace_back(flat.begin() + r * width, flat.begin() + (r + 1) * width);
  return rows;
}

std::string describe(const std::vector<int64_t>& row) {
  Shape s;
  for (int64_t d = 0; d < row[3]; ++d) s.push_back(row[size_t(4 + d)]);
  return fmt::format("{} {}", static_cast<DType>(row[2]), s);
}

// Raises on every rank alike unless every rank's plan is sound and the plans pair up; returns
// the rows every rank receives from each rank (column `me` of the split matrix).
std::vector<int64_t> agree_on_plans(const Plan& mine, const Group& g, const char* op,
                                    const char* what_agrees) {
  const std::vector<std::vector<int64_t>> rows = gather_plans(mine, g);
  const int n = g.size(), me = g.rank();
  if (mine.error) WEAVE_FAIL(op, "{}", *mine.error);
  for (int r = 0; r < n; ++r)
    WEAVE_CHECK(rows[size_t(r)][0] == 1, op,
                "rank {} of group {} rejected its arguments (see its error); nothing was sent",
                g.global_rank(r), g.str());
  for (int r = 1; r < n; ++r)
    WEAVE_CHECK(
        std::equal(rows[0].begin() + 2, rows[0].begin() + kHeader, rows[size_t(r)].begin() + 2), op,
        "ranks of group {} pass different {}: {} on rank {}, {} on rank {}", g.str(), what_agrees,
        describe(rows[0]), g.global_rank(0), describe(rows[size_t(r)]), g.global_rank(r));
  for (int r = 0; r < n; ++r) {
    const int64_t from = rows[size_t(r)][1];
    if (from < 0) continue;
    for (int j = 0; j < n; ++j) {
      const int64_t sent = rows[size_t(j)][size_t(kHeader + r)];
      WEAVE_CHECK(sent == (j == from ? 1 : 0), op,
                  "rank {} of group {} expects to receive from rank {}, but rank {} {}; hint: "
                  "`to` of every rank must be the rank whose `from` names it (a permutation)",
                  g.global_rank(r), g.str(), g.global_rank(int(from)), g.global_rank(j),
                  sent ? "sends to it" : "does not send to it");
    }
  }
  std::vector<int64_t> incoming;
  for (int j = 0; j < n; ++j) incoming.push_back(rows[size_t(j)][size_t(kHeader + me)]);
  return incoming;
}

// The exchange itself, recording nothing: rows of x go out by `out_splits`, arrive by
// `in_splits`, concatenated in rank order.
Tensor raw_uneven(const Tensor& x, const std::vector<int64_t>& out_splits,
                  const std::vector<int64_t>& in_splits, const Group& g) {
  Tensor out =
      empty(with_dim(x.shape(), 0, std::accumulate(in_splits.begin(), in_splits.end(), int64_t{0})),
            like(x));
  dist::all_to_all(out, x.contiguous(), in_splits, out_splits, g);
  return out;
}

// The local checks of an uneven all_to_all: what this rank would raise alone.
std::optional<std::string> split_error(const Tensor& x, const std::vector<int64_t>& splits,
                                       const Group& g) {
  if (!x.defined()) return "input is an undefined tensor";
  if (x.dim() < 1) return "expected a tensor with at least 1 dimension, found a 0-d one";
  if (int(splits.size()) != g.size())
    return fmt::format("expected one split size per rank of group {} ({}), found {}", g.str(),
                       g.size(), splits.size());
  for (int64_t s : splits)
    if (s < 0) return fmt::format("split sizes must be non-negative, found {}", splits);
  const int64_t rows = std::accumulate(splits.begin(), splits.end(), int64_t{0});
  if (rows != x.size(0))
    return fmt::format(
        "the split sizes {} add up to {}, but the input has {} rows along axis 0; hint: split "
        "sizes count rows of axis 0, one entry per rank",
        splits, rows, x.size(0));
  return std::nullopt;
}

}  // namespace

}  // namespace detail

using namespace detail;

Tensor all_to_all(const Tensor& x, const std::vector<int64_t>& input_splits, const Group& g,
                  std::vector<int64_t>* output_splits) {
  const char* op = "all_to_all";
  if (alone_in(g, op)) {
    if (auto error = split_error(x, input_splits, g)) WEAVE_FAIL(op, "{}", *error);
    if (output_splits) *output_splits = input_splits;
    return x;
  }
  Plan plan;
  plan.error = split_error(x, input_splits, g);
  plan.splits = input_splits;
  if (!plan.error) {
    plan.dtype = x.dtype();
    plan.signature = x.shape();
    plan.signature[0] = 0;  // rows may differ; the rest must not
  }
  const std::vector<int64_t> incoming =
      agree_on_plans(plan, g, op, "dtypes or row shapes (beyond axis 0)");
  if (output_splits) *output_splits = incoming;
  return all_to_all(x, input_splits, incoming, g);
}

Tensor all_to_all(const Tensor& x, const std::vector<int64_t>& input_splits,
                  const std::vector<int64_t>& output_splits, const Group& g) {
  if (alone_in(g, "all_to_all")) return all_to_all(x, input_splits, g);
  {
    // A bad tensor raises on every rank: this call still takes its turn, flagged as failed.
    const dist::detail::Call turn(dist::detail::Op::AllToAllV, g);
    check_input(x, "all_to_all");
    WEAVE_CHECK(x.dim() >= 1, "all_to_all",
                "expected a tensor with at least 1 dimension, found a 0-d one");
  }
  Tensor y = quietly([&] { return raw_uneven(x, input_splits, output_splits, g); });
  // adjoint: the same exchange backwards (what arrived goes back where it came from)
  return record("AllToAllUnevenBackward", x, y, wants_grad(x), [&] {
    return [out = input_splits, in = output_splits, g](const BackwardArgs& args) -> Grads {
      return {raw_uneven(args.grad(), in, out, g)};
    };
  });
}

Tensor send_recv(const Tensor& x, int to, int from, const Group& g) {
  const char* op = "send_recv";
  const int n = g.size();
  Plan plan;
  plan.expected_from = from;
  if (!x.defined())
    plan.error = "input is an undefined tensor";
  else if (to < 0 || to >= n || from < 0 || from >= n)
    plan.error = fmt::format("to {} and from {} must be ranks of group {} (0 to {})", to, from,
                             g.str(), n - 1);
  if (alone_in(g, op)) {
    if (plan.error) WEAVE_FAIL(op, "{}", *plan.error);
    return x;
  }
  if (plan.error) plan.expected_from = -1;
  if (!plan.error) {
    plan.splits.assign(size_t(n), 0);
    plan.splits[size_t(to)] = 1;
    plan.dtype = x.dtype();
    plan.signature = x.shape();
  }
  agree_on_plans(plan, g, op, "dtypes or shapes");
  std::vector<int64_t> sends(size_t(n), 0), receives(size_t(n), 0);
  sends[size_t(to)] = 1;
  receives[size_t(from)] = 1;
  const Shape shape = x.shape();
  Tensor y = quietly([&] {
    return raw_uneven(x.reshape({1, x.numel()}), sends, receives, g).reshape(shape);
  });
  // adjoint: the gradient of what arrived from `from` goes back to it; the gradient of what went
  // to `to` comes back from it
  return record("SendRecvBackward", x, y, wants_grad(x), [&] {
    return [sends, receives, shape, g](const BackwardArgs& args) -> Grads {
      const Tensor grad = args.grad().reshape({1, shape.numel()});
      return {raw_uneven(grad, receives, sends, g).reshape(shape)};
    };
  });
}

}  // namespace weave::dist::functional
