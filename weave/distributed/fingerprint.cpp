// Fingerprints of collective calls: description, comparison and the group-wide check.
#include "weave/distributed/fingerprint.h"

#include <algorithm>

#include "weave/tensor/dtype.h"
#include "weave/tensor/error.h"

namespace weave::dist::detail {

const char* op_name(Op op) {
  static const char* names[] = {
      "all_reduce",     "broadcast", "reduce",  "all_gather", "all_gather_uneven",
      "reduce_scatter", "gather",    "scatter", "all_to_all", "all_to_all",
      "barrier",        "new_group", "send",    "recv"};
  return names[static_cast<int>(op)];
}

std::string describe(const Fingerprint& f) {
  std::string text = op_name(static_cast<Op>(f.op));
  if (f.ndim >= 0) {
    std::vector<std::string> dims;
    for (int i = 0; i < f.ndim; ++i)
      dims.push_back(f.dims[i] < 0 ? "*" : std::to_string(f.dims[i]));
    text += fmt::format("({} [{}]", dtype_name(static_cast<DType>(f.dtype)), fmt::join(dims, ", "));
    if (f.root >= 0) text += fmt::format(", root {}", f.root);
    if (f.wire == static_cast<int32_t>(DeviceType::CUDA)) text += ", via NCCL";
    text += ")";
  }
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

bool same_call(const Fingerprint& a, const Fingerprint& b) {
  if (a.sequence != b.sequence || a.op != b.op || a.dtype != b.dtype || a.root != b.root ||
      a.ndim != b.ndim || a.reduce_op != b.reduce_op || a.extra != b.extra || a.wire != b.wire)
    return false;
  return std::equal(a.dims, a.dims + std::max(a.ndim, 0), b.dims);
}

// Compares this rank's fingerprint with the group's; raises on every rank if any differs.
void verify(Communicator& host, const std::vector<int>& ranks, const Fingerprint& mine) {
  std::vector<Fingerprint> all(ranks.size());
  host.all_gather(&mine, all.data(), sizeof(Fingerprint), kUInt8);
  bool agree = true;
  for (const Fingerprint& f : all) agree = agree && same_call(f, all[0]);
  if (agree) return;
  std::vector<std::string> calls;
  for (const Fingerprint& f : all)
    calls.push_back(fmt::format("rank {} called {}", f.rank, describe(f)));
  WEAVE_FAIL(op_name(static_cast<Op>(mine.op)),
             "collective mismatch in group [{}]: {}; hint: every rank of a group must issue the "
             "same collectives, with the same dtypes and shapes, in the same order",
             fmt::join(ranks, ", "), fmt::join(calls, ", "));
}

}  // namespace weave::dist::detail
