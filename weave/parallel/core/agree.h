#pragma once
// How the ranks of a group agree (internal to parallel/): every "do all ranks agree?" and every
// exchange of bytes between ranks in parallel/ goes through these functions, so that a failure
// on one rank becomes an error on every rank, never a hang.
//
// The questions answered by a maximum go through dist::agree_max (one board round per 15 words
// when the ranks share a machine, else one all_reduce; the collective guard rides along):
//
//   question                                   function         cost
//   did this hold on every rank?               all_agree        agree_max of one word
//   run a step; did it succeed everywhere?     run_together     the step, then all_agree
//   check my arguments, and do the ranks       check_together   the checks, then agree_max
//     agree on these numbers?                                     of 2n + 1 words
//   the lowest and highest of each number      value_range      agree_max of 2n words
//   on which ranks does each fact hold?        ranks_where      agree_max of facts x ranks words
//   every rank's bytes, everywhere             all_gather_bytes an all_gather of the lengths,
//                                                                 then of the bytes
//   root's bytes, everywhere                   broadcast_bytes  two broadcasts
//   every rank's bytes, at root                gather_bytes     an all_gather, then sends
//   do the ranks hold the same lines?          check_same_lines all_gather_bytes
#include <functional>
#include <string>
#include <vector>

#include "weave/distributed/distributed.h"

namespace weave::nn {
class Module;
}

namespace weave::parallel::detail {

/// True on every rank iff `mine` is true on every rank of the group. Collective.
bool all_agree(bool mine, const dist::Group& group);

/// Runs `step` on this rank, then learns whether it succeeded on every rank: a rank whose step
/// raised (anything: weave::Error, bad_alloc, a filesystem error) re-raises its own error, and
/// every other rank raises "[op] another rank of group G failed to <what>; see its error".
/// Collective: one agreement after the step.
void run_together(const char* op, const dist::Group& group, const std::string& what,
                  const std::function<void()>& step);

/// The lowest and the highest of each value over the group's ranks: all ranks passed the same
/// values iff lowest == highest.
struct ValueRange {
  std::vector<int64_t> lowest, highest;
  bool same(size_t i) const { return lowest[i] == highest[i]; }
};
/// Collective: one agreement (the maxima of the values and of their negations).
ValueRange value_range(const std::vector<int64_t>& values, const dist::Group& group);

/// Runs this rank's argument `checks`, then agrees on the outcome over the group before anything
/// else is communicated: a rank whose checks raised re-raises its error, and every other rank
/// raises too ("a rank of group ... rejected its arguments"), so none waits for a peer that
/// gave up. `values` travel in the same agreement, read after the checks ran (which may fill
/// them); their range over the group is returned.
/// Values must be greater than INT64_MIN. Collective: one agreement.
ValueRange check_together(const std::function<void()>& checks, const dist::Group& group,
                          const char* op, const std::vector<int64_t>& values = {});

/// For each of this rank's `facts`, the group ranks on which it holds (ascending): counts and
/// names of the ranks that failed, or still train. Collective: one agreement of one word per
/// fact and rank.
std::vector<std::vector<int>> ranks_where(const std::vector<bool>& facts, const dist::Group& group);

/// Every rank's `mine`, in group-rank order, on every rank. Collective.
std::vector<std::string> all_gather_bytes(const std::string& mine, const dist::Group& group);
/// Group rank `root`'s `bytes` (ignored elsewhere), on every rank. Collective.
std::string broadcast_bytes(const std::string& bytes, int root, const dist::Group& group);
/// Every rank's `mine`, in group-rank order, at group rank `root`; nothing elsewhere. Every
/// rank's bytes are received before the function returns, so the root may fail afterwards
/// without leaving a sender waiting. Collective.
std::vector<std::string> gather_bytes(const std::string& mine, int root, const dist::Group& group);

/// Raises weave::Error on every rank of the group unless every rank holds the same `lines`:
/// "[op] ranks disagree on <what>: entry 3 is '...' on rank 0 but '...' on rank 2; hint: <hint>".
/// Collective.
void check_same_lines(const std::vector<std::string>& lines, const dist::Group& group,
                      const char* op, const std::string& what, const std::string& hint);

/// check_same_lines without raising: the same message on every rank of the group ("ranks
/// disagree on ...", without the op), or "" when they agree. Collective.
std::string lines_disagreement(const std::vector<std::string>& lines, const dist::Group& group,
                               const std::string& what, const std::string& hint);

/// Checks whose groups overlap (HSDP's shard and replicate groups, tensor-parallel groups inside
/// a wrapper's): each check runs without raising, its error is kept, and share() spreads the
/// first error over a group; after rounds over groups that together connect every rank, all
/// raise together, and no rank waits in a later round for a peer that already raised.
///
///   Verdict verdict("FullyShardedDataParallel");
///   verdict.check([&] { check_my_arguments(); });
///   verdict.note(lines_disagreement(lines, shard, "the model", hint));
///   verdict.share(shard); verdict.share(replicate); verdict.share(shard);
///   verdict.raise_if_failed();
class Verdict {
 public:
  explicit Verdict(const char* op) : op_(op) {}
  /// Runs `check` on this rank, keeping what it raised (anything) unless an error is kept.
  void check(const std::function<void()>& check);
  /// Keeps `error` (without the op: it is added) unless it is empty or an error is kept.
  void note(const std::string& error);
  /// Collective over `group` (this rank a member): afterwards every member keeps the error of
  /// the lowest group rank that kept one, or its own.
  void share(const dist::Group& group);
  bool failed() const { return !error_.empty(); }
  /// Raises the kept error (this rank's own, or a peer's naming that rank).
  void raise_if_failed() const;

 private:
  const char* op_;
  std::string error_;
};

/// "parameter 3 float32 [4, 5]" for each tensor.
std::vector<std::string> describe_tensors(const std::vector<Tensor>& tensors);
/// "parameter 3 crc32 1a2b3c4d": each tensor's values, as a checksum of its bytes.
std::vector<std::string> describe_values(const std::vector<Tensor>& tensors);

}  // namespace weave::parallel::detail
