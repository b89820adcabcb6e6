#pragma once
// The backend interface (internal): one connection among the ranks of a group. Buffers are
// contiguous and live where the backend moves data (host memory for MPI, the device for NCCL);
// counts are elements per rank; roots and peers are ranks of this communicator. Calls block
// until the operation is complete. Tensor handling, ordering, checks and timeouts live above,
// in queue.cpp, runtime.cpp and collectives.cpp.
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "weave/distributed/types.h"
#include "weave/tensor/dtype.h"

namespace weave::dist::detail {

/// A send in flight (Communicator::start_send): its buffer stays untouched until done().
class PendingSend {
 public:
  virtual ~PendingSend() = default;
  /// True once the buffer may be reused (polling also drives the transfer on).
  virtual bool done() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int size() const = 0;
  virtual int rank() const = 0;

  /// op is never Avg (see all_reduce_mean).
  virtual void all_reduce(const void* in, void* out, int64_t count, DType dtype, ReduceOp op) = 0;
  /// The mean over the ranks (a floating dtype), when the backend can fold the division into
  /// the reduction itself: returns true when done, false to let the layer above sum and scale.
  virtual bool all_reduce_mean(const void*, void*, int64_t, DType) { return false; }
  virtual void broadcast(void* buffer, int64_t count, DType dtype, int root) = 0;
  /// out matters on root only; in == out means in place.
  virtual void reduce(const void* in, void* out, int64_t count, DType dtype, ReduceOp op,
                      int root) = 0;
  virtual void all_gather(const void* in, void* out, int64_t count, DType dtype) = 0;
  /// counts[r] elements come from rank r, concatenated in rank order.
  virtual void all_gather_v(const void* in, void* out, const std::vector<int64_t>& counts,
                            DType dtype) = 0;
  /// in holds size() * count elements; out receives this rank's reduced block.
  virtual void reduce_scatter(const void* in, void* out, int64_t count, DType dtype,
                              ReduceOp op) = 0;
  virtual void gather(const void* in, void* out, int64_t count, DType dtype, int root) = 0;
  virtual void scatter(const void* in, void* out, int64_t count, DType dtype, int root) = 0;
  /// count elements to and from every rank.
  virtual void all_to_all(const void* in, void* out, int64_t count, DType dtype) = 0;
  virtual void all_to_all_v(const void* in, const std::vector<int64_t>& send_counts, void* out,
                            const std::vector<int64_t>& recv_counts, DType dtype) = 0;
  /// A send alone may complete only once its receive is posted (NCCL's ncclSend, MPI under
  /// WEAVE_MPI_SEND=synchronous): two ranks that send to each other before receiving deadlock.
  virtual void send(const void* buffer, int64_t count, DType dtype, int dst, int tag) = 0;
  virtual void recv(void* buffer, int64_t count, DType dtype, int src, int tag) = 0;
  /// One part of an exchange: bytes to send to, or receive from, a peer.
  struct Part {
    bool send;
    void* bytes;
    int64_t size;
    int peer;
  };
  /// Every part at once, as one grouped operation (nonblocking sends and receives, then a wait
  /// for all; ncclGroupStart ... ncclGroupEnd): no part waits for a peer to post first, so a
  /// ring of exchanges cannot deadlock.
  virtual void exchange(const std::vector<Part>& parts, int tag) = 0;
  /// One send and one receive, grouped.
  void send_recv(const void* send_buffer, int64_t send_count, int dst, void* recv_buffer,
                 int64_t recv_count, int src, DType dtype, int tag) {
    const auto bytes = [dtype](int64_t count) { return count * int64_t(itemsize(dtype)); };
    exchange({{true, const_cast<void*>(send_buffer), bytes(send_count), dst},
              {false, recv_buffer, bytes(recv_count), src}},
             tag);
  }
  /// Starts a send that needs no matching receive to return; null when it already completed
  /// (the default: backends without a non-blocking send block in send()).
  virtual std::unique_ptr<PendingSend> start_send(const void* buffer, int64_t count, DType dtype,
                                                  int dst, int tag) {
    send(buffer, count, dtype, dst, tag);
    return nullptr;
  }
  virtual void barrier() = 0;
  /// Collective over this communicator: members (ranks of this communicator, in the new
  /// group's order) get the new communicator, everyone else null.
  virtual std::unique_ptr<Communicator> split(const std::vector<int>& members) = 0;
};

/// The backend of a world of one process (programs not started by mpirun): copies in to out.
std::unique_ptr<Communicator> make_local_communicator();

/// What the MPI backend (or its stub) provides.
namespace mpi {
/// True when this process was started by an MPI launcher.
bool launched();
/// MPI_Init (thread multiple) and a duplicate of MPI_COMM_WORLD.
std::unique_ptr<Communicator> init_world();
int local_rank();
/// More ranks run on this machine than it has cores (waits should yield theirs).
bool cores_shared();
void finalize();
/// Tears the whole job down (MPI_Abort).
[[noreturn]] void abort_job(int code);
/// A barrier of the whole world on a communicator of its own (so it can never pair with a
/// collective a peer is stuck in); false if it did not complete within timeout_ns, or if a
/// peer reported (report_waiting) that it waits for this rank in a collective, whose report is
/// then in *waiting.
bool farewell(int64_t timeout_ns, std::string* waiting);
/// Tells every other rank, on that communicator, that this rank is leaving, with `notice`
/// (what it issued on each group). Completed by finish_leaving().
void announce_leaving(const std::vector<int64_t>& notice);
/// A leaving notice from another rank, if one has arrived: its rank and contents.
std::optional<std::pair<int, std::vector<int64_t>>> poll_leaving();
/// Receives the notices of every rank not yet polled (`polled` of them were) and completes this
/// rank's own; after farewell() succeeded, so every rank has sent one.
void finish_leaving(int polled);
/// Tells leaving rank `rank` why this rank waits for it (what farewell() reports there).
void report_waiting(int rank, const std::string& report);
/// The watchdogs' messages to each other (roll_call.cpp): a rank whose call timed out asks its
/// peers what they last issued on that group, and they answer. And a failing rank's error, sent
/// to rank 0, with rank 0's verdict back (error_report.cpp).
enum class Control { RollCall, RollAnswer, ErrorReport, ErrorVerdict };
/// Sends `bytes` to world rank `rank` on the control communicator, without waiting.
void send_control(int rank, Control kind, std::string bytes);
/// A message of that kind from any rank, if one has arrived: the sender and the bytes.
std::optional<std::pair<int, std::string>> poll_control(Control kind);
}  // namespace mpi

/// What the NCCL backend (or its stub) provides.
namespace nccl {
/// True when weave was built with NCCL.
bool available();
/// The world's NCCL communicator on `device`, bootstrapped over the host world communicator.
std::unique_ptr<Communicator> init_world(Communicator& host_world, int device);
}  // namespace nccl

}  // namespace weave::dist::detail
