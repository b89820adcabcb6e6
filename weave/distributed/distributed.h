#pragma once
// Communication: process groups and (non-differentiable) collectives over MPI and NCCL.
//
// Launch with mpirun; a program started without it runs as a world of size 1.
//
//   weave::dist::InitGuard guard(weave::dist::Backend::MPI);
//   Tensor t = ones({4}) * double(weave::dist::rank());
//   weave::dist::all_reduce(t);                          // blocking, in place: sum over ranks
//   auto work = weave::dist::all_reduce(t, ReduceOp::Max, weave::dist::world(), true);
//   ...                                                  // overlap computation
//   work.wait();
//
// Collectives of one group run in program order on that group's communication queue. Every
// call takes `async_op`: false waits before returning, true returns a Work to wait on later.
// Roots are group ranks: position in the group's rank list (the first listed is root 0).
//
// Environment: WEAVE_TIMEOUT_S (default 300) -- a collective running longer tears the job down
// with a message naming it; WEAVE_CHECK_COLLECTIVES -- how ranks check that they issued the
// same call (see CheckMode): unset or "guard" (the default), "1" or "full", "0" or "off".
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "weave/distributed/tags.h"
#include "weave/distributed/types.h"
#include "weave/tensor/process_memory.h"
#include "weave/tensor/tensor.h"

namespace weave::dist {

/// How the ranks of a group check, before each collective, that they all issued the same call
/// (sequence number, op, dtype, shape, root, reduce op), and that a point-to-point receive
/// matches what was sent. A mismatch raises weave::Error on every rank involved, naming what
/// each rank called and the fields that differ; so does a rank's own argument error, which
/// reaches its peers instead of leaving them waiting.
enum class CheckMode {
  /// Nothing is checked: a mismatch may hang or give wrong values. For measuring the guard.
  Off,
  /// The default: the maximum of 24 bytes over the group before each collective (in memory
  /// the ranks share when they run on one machine, else one all_reduce; the full comparison
  /// runs only when it finds a difference) and a small header ahead of each point-to-point
  /// message.
  Guard,
  /// Also all-gathers every call's whole description and checks that all_to_all splits pair up.
  Full,
};

struct InitOptions {
  /// CUDA devices to assign round-robin by local rank (empty: all visible devices).
  std::vector<int> cuda_devices;
  /// Seconds before a collective is declared hung; <= 0 reads WEAVE_TIMEOUT_S (default 300).
  double timeout_s = 0;
  /// Unset reads WEAVE_CHECK_COLLECTIVES. Every rank must use the same mode (init checks).
  std::optional<CheckMode> check;
};

/// Starts the communication layer (MPI_Init when launched by mpirun). Raises if already up.
void init(Backend backend = Backend::MPI, InitOptions options = {});
bool initialized();

/// The check mode in force (InitOptions::check, WEAVE_CHECK_COLLECTIVES or set_check_mode).
CheckMode check_mode();
/// Switches the check mode for every call issued after it; calls issued before keep theirs.
/// Collective over the world: every rank calls it at the same point of its program, with the
/// same mode, while no other thread issues collectives. It raises on every rank, and changes
/// nothing, when the ranks ask for different modes or a point-to-point message sent before it
/// is not yet received (its receive, issued after, would expect the other kind of message).
/// For a job that checks its first steps in full and then runs guarded, or a benchmark that
/// measures the guard on the same calls.
void set_check_mode(CheckMode mode);
/// Waits for outstanding work and for every rank to reach finalize, then shuts down
/// (MPI_Finalize). A rank that waits longer than WEAVE_TIMEOUT_S for the others (they are stuck,
/// or a rank left early) aborts the job instead of hanging. Groups created before it are
/// unusable afterwards, even after a new init(). Safe to call twice.
void finalize();
/// Runs fn at the start of the next finalize(), before any group is drained: work a layer above
/// left for later that still communicates (a background checkpoint's commit). Hooks run in
/// reverse order of registration; one that raises does not stop the rest, and once the session
/// is down finalize() raises weave::Error naming every hook's failure
/// (InitGuard's destructor prints it and exits with status 1). Forgotten after that finalize.
void at_finalize(std::function<void()> fn);

/// init() in the constructor, finalize() in the destructor. If an exception leaves the guard's
/// scope in a job of several ranks, the others may be waiting for this one inside a collective:
/// instead of finalizing (which would wait for them), it ends the job as exit_with_error does,
/// with the last error (the exception never reaches a catch outside the guard: catch it inside,
/// below). If finalize() raises (work left for it failed), the process prints the error and
/// exits with status 1.
class InitGuard {
 public:
  explicit InitGuard(Backend backend = Backend::MPI, InitOptions options = {})
      : unwinding_at_start_(std::uncaught_exceptions()) {
    init(backend, std::move(options));
  }
  ~InitGuard();
  InitGuard(const InitGuard&) = delete;
  InitGuard& operator=(const InitGuard&) = delete;

 private:
  int unwinding_at_start_;
};

/// Ends the job after an error that main caught while its InitGuard is alive, printing the
/// error once for the whole job rather than once per rank:
///
///   int main() {
///     dist::InitGuard guard;
///     try {
///       train();
///     } catch (const std::exception& e) {
///       dist::exit_with_error(e);  // never returns
///     }
///   }
///
/// Every rank that fails reports its message to rank 0, which waits until no new report has
/// come for WEAVE_ERROR_WAIT_S (default 2 s), then prints each distinct message once, with the
/// ranks that raised it: "[weave] ranks 0-3 (every rank): train: ...", "[weave] rank 2: ...".
/// When every rank failed, each finalizes (work left for finalize runs) and exits with status 1;
/// otherwise the ranks that raised nothing may wait for the others inside a collective, the
/// fold says which, and the job is aborted. A world of one prints the error and exits with 1.
[[noreturn]] void exit_with_error(const std::exception& error);

int rank();
int world_size();
/// Rank among the processes on this machine.
int local_rank();
Backend backend();
/// This rank's CUDA device under NCCL (assigned round-robin by local rank), else cpu.
Device device();

/// An ordered list of global ranks. A rank's position is its group rank; the first listed rank
/// is root 0. Every rank holds the same Group objects (non-members may hold one but not use it).
class Group {
 public:
  /// The world group.
  Group();
  const std::vector<int>& ranks() const;
  int size() const;
  /// This process's group rank, or -1 if it is not a member.
  int rank() const;
  bool contains(int global_rank) const;
  /// Global rank of group rank r.
  int global_rank(int group_rank) const;
  std::string str() const;
  /// The group's state: its communicators, queue and worker (distributed/queue.h, internal).
  struct Impl;
  const std::shared_ptr<Impl>& impl() const { return impl_; }
  explicit Group(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

 private:
  std::shared_ptr<Impl> impl_;
};

Group world();
/// Creates a group from global ranks (unique, in range). Every rank must call it, in the same
/// order, like the collectives.
Group new_group(const std::vector<int>& ranks);
/// Splits `parent` into disjoint subgroups (lists of its global ranks, each in its group order)
/// and returns the one that lists this rank; a rank listed in none gets a group it is not in
/// (rank() == -1). Collective over parent only: every member passes the same lists. Unlike
/// new_group, the rest of the world takes no part (a wrapper over a sub-axis can split it).
Group split_group(const Group& parent, const std::vector<std::vector<int>>& subgroups);
/// A new group of the same ranks in the same order, with communicators of its own: its
/// collectives never pair with the original's, so a background thread can communicate on it
/// while the training thread uses the original. Collective over the group (its members only).
Group duplicate(const Group& group);

/// Completion handle of a collective.
class Work {
 public:
  Work() = default;
  /// Blocks until the collective is done; rethrows its error, if any.
  void wait() const;
  bool is_completed() const;
  struct State;
  explicit Work(std::shared_ptr<State> state) : state_(std::move(state)) {}

 private:
  std::shared_ptr<State> state_;
};

/// Numbers the training step this rank is in on the group (-1: none). Every later collective on
/// the group carries the number and the guard compares it, so ranks in different steps raise
/// at once instead of pairing equal-shaped collectives across iterations; a rank that calls
/// finalize() while a peer waits for it reports the steps of both. The data-parallel wrappers
/// number their steps themselves; a hand-written loop may do the same.
void set_step(const Group& group, int64_t step);

/// Tells a supervising `weave-run --hang-timeout` that this rank is making progress: a line on
/// stderr that weave-run recognizes and keeps out of the job's output, at most one per
/// WEAVE_HEARTBEAT_S seconds (weave-run sets it); nothing when that variable is unset.
/// Every completed collective or point-to-point call beats, so training on any axis beats on
/// its own; a long phase without communication needs a KeepAlive (or calls to this).
void heartbeat();
/// Beats for this rank while it lives, from weave's watchdog thread: for long local work with
/// no communication (a checkpoint's save or load, which hold one, or an evaluation on one
/// rank). It holds back while one of this rank's calls has run longer than a beat interval, so
/// a rank stuck in a collective still looks hung to weave-run. Scopes nest.
///
///   { weave::dist::KeepAlive alive; run_long_evaluation(); }
class KeepAlive {
 public:
  KeepAlive();
  ~KeepAlive();
  KeepAlive(const KeepAlive&) = delete;
  KeepAlive& operator=(const KeepAlive&) = delete;
};

/// Returns once every rank of the group has reached it (after the group's earlier collectives).
void barrier(const Group& group = world());
/// Brings a group's ranks back in step after a collective mismatch (or a peer's failed call).
/// The check raises on every rank of the group at the same call, but the ranks may stand at
/// different points of their programs, some with calls queued behind it that can never pair.
/// Every rank of the group calls realign() once it has caught the error: it waits for this
/// rank's queued calls on the group (their errors stay in their Works), then meets its peers in
/// rounds. A round that meets a peer's late call fails it (so that peer raises and realigns as
/// well); the rounds end together once every rank is realigning, and the group's calls pair
/// again from the next one. Collective over the group. Under CheckMode::Off it only waits for
/// the queue: nothing is checked, so no mismatch is ever reported.
void realign(const Group& group = world());
/// How many calls on the group raised in the agreement step on this rank (a mismatch, or a
/// peer's failed call); the same count on every rank. Compared across a step, it tells whether
/// the step needs realign().
uint64_t disagreements(const Group& group = world());

// ---- agreement ----------------------------------------------------------------------------

/// `words` become their element-wise maximum over the group's ranks: the one way ranks agree
/// on a few numbers, which a maximum answers whatever the question. Did every rank succeed?
/// (the maximum of failure flags is 0). Did every rank pass the same value? (the maxima of v
/// and -v are v and -v). What is every rank's small plan? (each rank fills its own row, zeros
/// elsewhere). Every rank passes as many words. Its transport is the collective guard's own:
/// when the group's ranks share a machine, rounds of 15 words on a shared-memory board (one
/// store and one load per peer, the guard riding in the first), else one all_reduce.
/// Collective, blocking.
///
///   int64_t ok[1] = {loaded ? 0 : 1};
///   weave::dist::agree_max(ok, group);   // ok[0] == 0: every rank loaded
void agree_max(std::span<int64_t> words, const Group& group = world());
/// The same, on a copy.
std::vector<int64_t> agree_max(std::vector<int64_t> words, const Group& group = world());

/// The worst rank's memory over `group`: the largest tensor peak (memory_stats(device).peak)
/// and the largest resident peak (the process's, VmHWM), each with the global rank holding it
/// (the lowest on ties). Collective (one agreement); every rank gets the answer.
///
///   const MemoryPeaks worst = dist::max_memory_stats(device, mesh.data());
///   metrics.log_step({.step = step, .loss = loss, .memory = worst});
MemoryPeaks max_memory_stats(Device device = kCPU, const Group& group = world());

// ---- collectives (tensors of any dtype; CPU tensors, or CUDA under NCCL / staged over MPI) --

/// tensor = op over the group, in place.
Work all_reduce(const Tensor& tensor, ReduceOp op = ReduceOp::Sum, const Group& group = world(),
                bool async_op = false);
/// output = op over the group of input (input unchanged); same shape and dtype.
Work all_reduce(const Tensor& input, const Tensor& output, ReduceOp op,
                const Group& group = world(), bool async_op = false);
/// tensor = root's tensor.
Work broadcast(const Tensor& tensor, int root = 0, const Group& group = world(),
               bool async_op = false);
/// On root, tensor = op over the group; other ranks' tensors are unchanged.
Work reduce(const Tensor& tensor, ReduceOp op = ReduceOp::Sum, int root = 0,
            const Group& group = world(), bool async_op = false);
/// output [size * n, ...] = the inputs [n, ...] of every group rank, in group-rank order. The
/// input may be this rank's own slice of the output (in place: output.narrow(0, rank * n, n)).
Work all_gather(const Tensor& output, const Tensor& input, const Group& group = world(),
                bool async_op = false);
/// Inputs may differ in their first dimension; returns them concatenated (blocking).
Tensor all_gather_uneven(const Tensor& input, const Group& group = world());
/// output [n, ...] = group rank r's slice r of op over the inputs [size * n, ...].
Work reduce_scatter(const Tensor& output, const Tensor& input, ReduceOp op = ReduceOp::Sum,
                    const Group& group = world(), bool async_op = false);
/// On root, output [size * n, ...] = every rank's input [n, ...]; output is ignored elsewhere.
Work gather(const Tensor& output, const Tensor& input, int root = 0, const Group& group = world(),
            bool async_op = false);
/// output [n, ...] = slice r of root's input [size * n, ...]; input is ignored off root.
Work scatter(const Tensor& output, const Tensor& input, int root = 0, const Group& group = world(),
             bool async_op = false);
/// Equal splits along dim 0: slice j of input goes to rank j; output slice j comes from rank j.
Work all_to_all(const Tensor& output, const Tensor& input, const Group& group = world(),
                bool async_op = false);
/// Uneven splits along dim 0: input_splits[j] rows go to rank j, output_splits[j] come from it.
Work all_to_all(const Tensor& output, const Tensor& input,
                const std::vector<int64_t>& output_splits, const std::vector<int64_t>& input_splits,
                const Group& group = world(), bool async_op = false);
/// Point to point with a group rank; send and recv pair up by order (and tag). Tags from
/// dist::tags::kFirstReserved up are weave's own (tags.h lists them): use lower ones.
Work send(const Tensor& tensor, int dst, const Group& group = world(), int tag = 0,
          bool async_op = false);
Work recv(const Tensor& tensor, int src, const Group& group = world(), int tag = 0,
          bool async_op = false);
/// Starts sending tensor to group rank dst and returns without waiting for the receiver (so two
/// ranks may send to each other before either receives). The Work completes once tensor may be
/// modified again; until then tensor must not be written. Sends to one peer arrive in order.
/// The group also keeps the Work: wait_sends() (or finalize) waits for what is still in flight.
Work isend(const Tensor& tensor, int dst, const Group& group = world(), int tag = 0);
/// Sends to_send to group rank dst and receives to_receive from group rank src as one grouped
/// exchange: neither waits for the peer to post first, on any backend. A ring of these (every
/// rank sends right, receives from the left) cannot deadlock, where isend then recv can on NCCL,
/// whose send alone completes only once it is matched. The peers' exchanges pair by order.
Work send_recv(const Tensor& to_send, int dst, const Tensor& to_receive, int src,
               const Group& group = world(), int tag = 0, bool async_op = false);
/// Sends each of `sends` to the group rank in `to` (same order) and receives one tensor from
/// each rank in `from`, all as one grouped exchange (blocking): no part waits for a peer to post
/// first, on any backend, so steps that go both ways around a ring (an interleaved pipeline's
/// activations forward and gradients back) cannot wait on each other in a circle. What arrives
/// takes the dtype and shape its sender sent, on the CPU for a CPU tensor, else on this rank's
/// GPU. A peer's call pairs with this one when it lists this rank once per tensor going each
/// way, in the same order (two tensors to one peer arrive in the order sent). Empty lists: a
/// no-op.
//
//   // ring: an activation right, a gradient left, and the neighbours' in one call
//   auto got = dist::exchange({activation, grad}, {next, prev}, {prev, next});
std::vector<Tensor> exchange(const std::vector<Tensor>& sends, const std::vector<int>& to,
                             const std::vector<int>& from, const Group& group = world(),
                             int tag = 0);
/// Waits for every isend this rank started on the group (a pipeline schedule's step end).
void wait_sends(const Group& group = world());
/// Broadcasts every tensor from root, in place (a model's parameters and buffers).
void broadcast_tensors(const std::vector<Tensor>& tensors, int root = 0,
                       const Group& group = world());

}  // namespace weave::dist
