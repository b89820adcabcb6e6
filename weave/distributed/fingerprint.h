#pragma once
// The agreement check before every collective. By default (the guard) the ranks of the group
// take the maximum of 3 words (agreement.h: on the board, or an all_reduce): a hash of each rank's
// call in a form whose maximum shows whether all are equal, and a flag raised by a rank whose own
// call failed its argument checks. Only when that shows a difference do they all-gather the whole
// fingerprints for a message naming each rank's call. Full check mode (WEAVE_CHECK_COLLECTIVES=1)
// always all-gathers them.
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "weave/distributed/agreement_board.h"
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
  Recv,
  SetCheckMode,
  Realign,
  Agree
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
  /// 1 when this rank's call failed its own checks: instead of running it, the rank joins the
  /// agreement step with this set, so the others raise instead of waiting for it.
  int32_t failed = 0;
  /// The training step the group is in on this rank (dist::set_step; -1: not numbered). Two
  /// steps' collectives of equal shapes would otherwise pair silently across iterations.
  int64_t step = -1;
  /// 1 when this rank issued the call from inside a backward pass (for the teardown's hint:
  /// not part of the match, since ranks may issue one call from backward and from join()).
  int32_t from_backward = 0;
};

/// "all_reduce(float32 [4, 5]) #3"; "broadcast(float32 [8], root 0, via NCCL) #4 in step 7"
std::string describe(const Fingerprint& f);
/// The trace event arguments of a call: "call", "group" and "bytes" (per rank).
std::string trace_args(const Fingerprint& f, const std::vector<int>& ranks);
/// True when two ranks' fingerprints describe the same call.
bool same_call(const Fingerprint& a, const Fingerprint& b);
/// Compares this rank's fingerprint with those of the group's other ranks over `host` (the
/// group's host communicator); raises weave::Error on every rank, naming each rank's call and
/// the fields that differ, if any differs or a rank's call failed.
void verify(Communicator& host, const std::vector<int>& ranks, const Fingerprint& mine);
/// The default check: one agreement round (agreement.h) of 3 words, a hash of the call in a
/// form whose maximum shows whether every rank's is equal and the failed flag; calls verify()
/// (on every rank alike) only when the calls differ or a rank's call failed. `words`, a call's
/// own agreement (dist::agree_max), ride in the same round and any further ones.
void guard(Communicator& host, AgreementBoard* board, const std::vector<int>& ranks,
           const Fingerprint& mine, std::span<int64_t> words = {});

}  // namespace weave::dist::detail
