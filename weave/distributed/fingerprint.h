#pragma once
// Check mode (WEAVE_CHECK_COLLECTIVES=1): before a collective runs, every rank of the group
// all-gathers a fixed-size fingerprint of its call and compares it with the others'.
#include <cstdint>
#include <string>
#include <vector>

#include "weave/distributed/communicator.h"
#include "weave/tensor/device.h"
#include "weave/tensor/shape.h"

namespace weave::dist::detail {

enum class Op : int32_t {
  AllReduce,
  Broadcast,
  Reduce,
  AllGather,
  AllGatherV,
  ReduceScatter,
  Gather,
  Scatter,
  AllToAll,
  AllToAllV,
  Barrier,
  NewGroup,
  Send,
  Recv
};
/// "all_reduce", "broadcast", ...
const char* op_name(Op op);

// What every rank of the group must agree on before a collective runs.
struct Fingerprint {
  uint64_t sequence = 0;
  int32_t op = 0;
  int32_t dtype = -1;
  int32_t rank = 0;
  int32_t root = -1;
  int32_t ndim = -1;  // -1: no tensor
  int32_t reduce_op = -1;
  int64_t dims[kMaxDims] = {};  // -1 where ranks may differ (uneven sizes)
  int64_t extra = 0;            // op-specific (a hash of a new group's ranks)
  /// The device type the bytes travel on (kCPU: the host communicator, kCUDA: NCCL). Ranks
  /// that disagree would call different libraries and hang, so it is part of the call.
  int32_t wire = -1;
};

/// "all_reduce(float32 [4, 5]) #3"; "broadcast(float32 [8], root 0, via NCCL) #4"
std::string describe(const Fingerprint& f);
/// The trace event arguments of a call: "call", "group" and "bytes" (per rank).
std::string trace_args(const Fingerprint& f, const std::vector<int>& ranks);
/// True when two ranks' fingerprints describe the same call.
bool same_call(const Fingerprint& a, const Fingerprint& b);
/// Compares this rank's fingerprint with those of the group's other ranks over `host` (the
/// group's host communicator); raises weave::Error on every rank, naming each rank's call, if
/// any differs.
void verify(Communicator& host, const std::vector<int>& ranks, const Fingerprint& mine);

}  // namespace weave::dist::detail
