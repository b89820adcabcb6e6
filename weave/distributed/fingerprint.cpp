// Fingerprints of collective calls: description, comparison and the group-wide check.
#include "weave/distributed/fingerprint.h"

#include <algorithm>

#include "weave/distributed/agreement.h"
#include "weave/tensor/dtype.h"
#include "weave/tensor/error.h"

namespace weave::dist::detail {

const char* op_name(Op op) {
  static const char* names[] = {
      "all_reduce",     "broadcast", "reduce",  "all_gather", "all_gather_uneven",
      "reduce_scatter", "gather",    "scatter", "all_to_all", "all_to_all",
      "barrier",        "new_group", "send",    "recv",       "set_check_mode",
      "realign",        "agree_max"};
  return names[static_cast<int>(op)];
}

namespace {
const char* reduce_op_name(int32_t op) {
  static const char* names[] = {"sum", "prod", "min", "max", "avg"};
  return op >= 0 && op < 5 ? names[op] : "?";
}
}  // namespace

std::string describe(const Fingerprint& f) {
  std::string text = op_name(static_cast<Op>(f.op));
  if (f.ndim >= 0) {
    std::vector<std::string> dims;
    for (int i = 0; i < f.ndim; ++i)
      dims.push_back(f.dims[i] < 0 ? "*" : std::to_string(f.dims[i]));
    text += fmt::format("({} [{}]", dtype_name(static_cast<DType>(f.dtype)), fmt::join(dims, ", "));
    if (f.reduce_op >= 0) text += fmt::format(", {}", reduce_op_name(f.reduce_op));
    const auto op = static_cast<Op>(f.op);
    const char* peer = op == Op::Send ? "to" : op == Op::Recv ? "from" : "root";
    if (f.root >= 0) text += fmt::format(", {} {}", peer, f.root);
    if (op == Op::Send && f.extra > 0) text += fmt::format(", from {}", f.extra - 1);
    if (f.wire == static_cast<int32_t>(DeviceType::CUDA)) text += ", via NCCL";
    text += ")";
  }
  if (f.step >= 0) return fmt::format("{} #{} in step {}", text, f.sequence, f.step);
  return fmt::format("{} #{}", text, f.sequence);
}

std::string trace_args(const Fingerprint& f, const std::vector<int>& ranks) {
  std::string args =
      fmt::format("\"call\": \"{}\", \"group\": \"[{}]\"", describe(f), fmt::join(ranks, ", "));
  if (f.ndim >= 0) {
    int64_t elements = 1;
    for (int i = 0; i < f.ndim; ++i) elements *= std::max<int64_t>(f.dims[i], 0);
    args +=
        fmt::format(", \"bytes\": {}", elements * int64_t(itemsize(static_cast<DType>(f.dtype))));
  }
  return args;
}

namespace {

// The fields in which two calls differ, by name.
std::vector<std::string> differences(const Fingerprint& a, const Fingerprint& b) {
  std::vector<std::string> fields;
  // Constructed in place: GCC 12 misreads a moved temporary string here (-Warray-bounds).
  auto note = [&](bool differs, const char* name) {
    if (differs) fields.emplace_back(name);
  };
  note(a.sequence != b.sequence, "sequence number (a rank skipped or added a collective)");
  note(a.op != b.op, "op");
  note(a.dtype != b.dtype, "dtype");
  note(a.ndim != b.ndim || !std::equal(a.dims, a.dims + std::max(a.ndim, 0), b.dims), "shape");
  note(a.root != b.root, "root");
  note(a.reduce_op != b.reduce_op, "reduce op");
  note(a.extra != b.extra, "group ranks");
  note(a.step != b.step, "training step (dist::set_step)");
  // Only two calls that both move tensors can differ in transport (a call without a tensor,
  // such as a barrier or a failed call's report, has none).
  note(a.wire != b.wire && a.ndim >= 0 && b.ndim >= 0, "transport (NCCL vs MPI)");
  return fields;
}

// A hash of the fields every rank must agree on (not rank, not failed), a word at a time: each
// step (xor, multiply by an odd constant, fold the high half down) is a bijection of the
// running value, so two calls that differ in one field never collide. (Byte-wise FNV-1a was a
// chain of ~100 dependent multiplies: 10% of a guarded 8-byte all_reduce.)
uint64_t call_hash(const Fingerprint& f) {
  uint64_t h = 0x6a09e667f3bcc909ull;
  auto mix = [&h](int64_t v) {
    h = (h ^ static_cast<uint64_t>(v)) * 0x9e3779b97f4a7c15ull;
    h ^= h >> 32;
  };
  mix(static_cast<int64_t>(f.sequence));
  mix(f.op);
  mix(f.dtype);
  mix(f.root);
  mix(f.ndim);
  mix(f.reduce_op);
  for (int i = 0; i < std::max(f.ndim, 0); ++i) mix(f.dims[i]);
  mix(f.extra);
  mix(f.wire);
  mix(f.step);
  return h;
}

}  // namespace

bool same_call(const Fingerprint& a, const Fingerprint& b) {
  return differences(a, b).empty();
}

void verify(Communicator& host, const std::vector<int>& ranks, const Fingerprint& mine) {
  std::vector<Fingerprint> all(ranks.size());
  host.all_gather(&mine, all.data(), sizeof(Fingerprint), kUInt8);
  const char* name = op_name(static_cast<Op>(mine.op));
  for (const Fingerprint& f : all)
    WEAVE_CHECK(f.failed == 0, name,
                "rank {} of group [{}] rejected its arguments to {} and did not run it, so this "
                "rank's {} did not run either; see rank {}'s error",
                f.rank, fmt::join(ranks, ", "), describe(f), describe(mine), f.rank);
  std::vector<std::string> fields;
  for (const Fingerprint& f : all)
    for (const std::string& field : differences(f, all[0]))
      if (std::find(fields.begin(), fields.end(), field) == fields.end()) fields.push_back(field);
  if (fields.empty()) return;
  std::vector<std::string> calls;
  std::vector<int> from_backward;
  for (const Fingerprint& f : all) {
    calls.push_back(fmt::format("rank {} called {}", f.rank, describe(f)));
    if (f.from_backward) from_backward.push_back(f.rank);
  }
  // Some ranks in backward and some not: a communicating node one rank's backward skipped.
  const std::string skipped =
      from_backward.empty() || from_backward.size() == all.size()
          ? ""
          : fmt::format(
                "; rank(s) {} issued theirs from backward: if the others' backward skipped a "
                "node that communicates (a custom autograd::Function whose output their loss "
                "does not use), declare it with `static constexpr bool communicates = true`",
                fmt::join(from_backward, ", "));
  WEAVE_FAIL(name,
             "collective mismatch in group [{}]: {} (they differ in {}); hint: every rank of a "
             "group must issue the same collectives, with the same dtypes, shapes, roots and "
             "reduce ops, in the same order{}",
             fmt::join(ranks, ", "), fmt::join(calls, ", "), fmt::join(fields, ", "), skipped);
}

void guard(Communicator& host, AgreementBoard* board, const std::vector<int>& ranks,
           const Fingerprint& mine, std::span<int64_t> words) {
  // max(h) == h and max(~h) == ~h on a rank means h is both the largest and the smallest hash:
  // every rank reaches the same verdict without a second round.
  const auto h = static_cast<int64_t>(call_hash(mine));
  int64_t round[kRoundWords] = {h, ~h, mine.failed};
  constexpr size_t kGuardWords = 3;
  const size_t riding = std::min(words.size(), kRoundWords - kGuardWords);
  std::copy_n(words.begin(), riding, round + kGuardWords);
  max_round(host, board, round);
  if (round[0] != h || round[1] != ~h || round[2] != 0) {
    verify(host, ranks, mine);  // every rank gets here: the full comparison names the difference
    WEAVE_FAIL(op_name(static_cast<Op>(mine.op)),
               "the ranks of group [{}] disagree about {} (their call hashes differ)",
               fmt::join(ranks, ", "), describe(mine));
  }
  // The calls agree, so every rank holds as many words: the rest take the same rounds.
  std::copy_n(round + kGuardWords, riding, words.begin());
  max_words(host, board, words.subspan(riding));
}

}  // namespace weave::dist::detail
