#pragma once
// The process-wide runtime (internal): init/finalize, the group registry, the watchdog, and
// issue(), through which every front end in collectives.cpp submits its call.
#include <atomic>
#include <exception>
#include <functional>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "weave/distributed/queue.h"

namespace weave::dist::detail {

struct Runtime {
  bool up = false;
  std::vector<std::function<void()>> finalize_hooks;  // at_finalize's, run first by finalize
  Backend backend = Backend::MPI;
  bool uses_mpi = false;
  double timeout_s = 300;
  /// timeout_s in nanoseconds, saturated: beyond int64 (about 292 years, or inf) means never.
  int64_t timeout_ns = int64_t{300} * 1000000000;
  std::atomic<CheckMode> check{CheckMode::Guard};
  /// Point-to-point messages this rank issued to, and receives it issued from, each world
  /// rank: set_check_mode refuses to switch while one is in flight.
  std::unique_ptr<std::atomic<int64_t>[]> sent_to, received_from;
  /// heartbeat()'s least interval (WEAVE_HEARTBEAT_S, set by weave-run --hang-timeout); 0: off.
  int64_t heartbeat_ns = 0;
  std::atomic<int64_t> last_heartbeat_ns{0};
  /// Live KeepAlive scopes: the watchdog beats for the rank while there is one.
  std::atomic<int> keep_alive_scopes{0};
  int rank = 0, size = 1, local_rank = 0;
  Device device = kCPU;
  std::shared_ptr<Group::Impl> world;
  std::mutex groups_mutex;
  std::vector<std::weak_ptr<Group::Impl>> groups;
  int64_t next_group_id = 0;  // new_group runs on every rank in one order: ids agree
  std::thread watchdog;
  std::atomic<bool> stop_watchdog{false};
  /// Leaving notices of other ranks (mpi::poll_leaving) the watchdog has received.
  std::atomic<int> leaving_polled{0};
};

/// The process-wide state (never destroyed: worker threads may outlive statics).
Runtime& runtime();
/// WEAVE_CHECK_COLLECTIVES's mode (the guard when unset); raises for an unknown value.
CheckMode check_mode_from_env();
/// Raises, tagged `op`, unless `mode` is one of the three check modes.
void check_is_mode(CheckMode mode, const char* op);
/// Collective over `world`: raises on every rank, naming `op` and ending with `hint`, unless
/// every rank passes the same mode and no point-to-point message is in flight (sent before
/// this call, with no receive issued before it).
void agree_on_check_mode(Communicator& world, AgreementBoard* board, CheckMode mode, const char* op,
                         const char* hint);
/// runtime(), after checking that init() ran; `op` names the caller in the error.
Runtime& live(const char* op);
/// Reports on stderr that `what` did not complete within the timeout and aborts the whole job
/// (the watchdog's verdict; also used by waits that poll instead of blocking in a call).
[[noreturn]] void tear_down_after_timeout(const std::string& what);
/// Rank 0's watchdog: collects the errors failing ranks report (error_report.cpp) and, once they
/// stop coming while rank 0 itself has raised none, prints them once and aborts the job.
void serve_error_reports();
/// Ends the job for `message`, this rank's error, printed once for the whole job (rank 0 folds
/// every failing rank's report); a world of one prints it and exits with status 1.
[[noreturn]] void end_job_with_error(const std::string& message);
/// Answers the roll calls other ranks' watchdogs sent this rank (roll_call.cpp); returns the ids
/// of the groups they asked about.
std::vector<int64_t> serve_roll_calls();
/// A call of `g` timed out on this rank (or a peer timed out in it: `asked_by_peer`; or it can
/// never complete: `deadlock`, find_deadlock's story): holds the roll call, writes the flight
/// recorder, reports, and tears the job down.
[[noreturn]] void time_out(Group::Impl& g, bool asked_by_peer, const std::string& deadlock = "");
/// How long a point-to-point call runs before the watchdog probes its partners.
inline constexpr int64_t kProbeAfterNs = 1000000000;
/// When g's running point-to-point call has run kProbeAfterNs, asks its partners where they
/// stand (once per kProbeAfterNs). A partner found twice in a row inside one collective of g
/// that this rank has not issued (it can only run after this call), with no send of its own in
/// flight, makes a cycle: returns its story ("" otherwise, and for calls of other kinds).
std::string find_deadlock(Group::Impl& g);
/// The partners (world ranks, not this one) of a point-to-point call, where its fingerprint
/// names them: the peer and, for send_recv, the rank it receives from.
std::vector<int> partners_of(const Group::Impl& g, const Fingerprint& call);
/// Prints "[weave] rank r: <what>" on stderr.
void report(const std::string& what);
/// Prints "[weave] rank r: <why>; tearing the job down" on stderr and aborts the whole job.
[[noreturn]] void tear_down(const std::string& why);

/// Prints this rank's report (`why` and the last weave::Error) and aborts the job, when it is a
/// job of several MPI ranks that may be waiting for this one; otherwise returns.
void abort_if_peers_wait(const std::string& why);

/// A group over `ranks` with its host communicator (null on non-members), registered with the
/// watchdog.
std::shared_ptr<Group::Impl> make_group(std::vector<int> ranks, std::unique_ptr<Communicator> comm);

struct Call;
/// Issues the call `c` that this rank could not issue with nothing to run and
/// Fingerprint::failed set, so the group's agreement step raises on the other ranks too
/// (nothing for point-to-point calls). Never throws.
void report_failure(const Call& c) noexcept;

// Everything one collective call needs from its caller.
struct Call {
  Op op;
  const Group& group;
  const char* name;
  mutable bool issued = false;  // issue() took it; before that, an error is the caller's own
  int unwinding_at_start;

  Call(Op o, const Group& g)
      : op(o), group(g), name(op_name(o)), unwinding_at_start(std::uncaught_exceptions()) {}
  Call(Op, Group&&) = delete;  // group is held by reference: a temporary would dangle
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;
  // A collective whose front end raised before issuing it (a bad argument on this rank only)
  // still takes its turn, flagged as failed: the other ranks raise instead of waiting.
  ~Call() {
    if (!issued && std::uncaught_exceptions() > unwinding_at_start) report_failure(*this);
  }
};

inline Group::Impl& member(const Call& c) {
  live(c.name);
  Group::Impl& g = *c.group.impl();
  WEAVE_CHECK(!g.finished, c.name,
              "group {} belongs to a session that finalize() ended; hint: create groups again "
              "after init()",
              c.group.str());
  WEAVE_CHECK(g.my_rank >= 0, c.name,
              "rank {} is not in group {}; hint: only members may call its collectives",
              runtime().rank, c.group.str());
  return g;
}

/// The agreement step before a collective runs (see CheckMode); `words` (agree_max's) become
/// their maximum over the group in the same step, whatever the mode.
void agree(Group::Impl& g, const Fingerprint& print, CheckMode mode, std::span<int64_t> words = {});

// One thread issues on a group at a time: the ranks must see the same order, and two threads'
// calls on one rank have none. A second thread arriving while one is inside issue() (which, for
// a blocking call, lasts until it completes) is an error, not a race.
class IssuingThread {
 public:
  IssuingThread(Group::Impl& g, const Call& c) : g_(g) {
    std::thread::id holder;
    if (g.issuer.compare_exchange_strong(holder, std::this_thread::get_id())) {
      owned_ = true;
      return;
    }
    WEAVE_CHECK(holder == std::this_thread::get_id(), c.name,
                "two threads issued collectives on group {} at the same time; the ranks would "
                "see them in different orders; hint: one thread per group (new_group gives each "
                "thread its own)",
                c.group.str());
  }
  ~IssuingThread() {
    if (owned_) g_.issuer.store(std::thread::id());
  }
  IssuingThread(const IssuingThread&) = delete;
  IssuingThread& operator=(const IssuingThread&) = delete;

 private:
  Group::Impl& g_;
  bool owned_ = false;
};

// Runs `body` on the group in program order, after the agreement step (CheckMode), which also
// takes the maximum of `words` (blocking calls only: the span is the caller's). Point-to-point
// calls (collective = false) take no sequence number; their check travels with them.
template <class Body>
Work issue(const Call& c, Fingerprint print, bool collective, Body&& body, bool async_op,
           std::span<int64_t> words = {}) {
  Group::Impl& g = member(c);
  c.issued = true;
  IssuingThread one_thread(g, c);
  const CheckMode mode = runtime().check;
  if (collective) {
    print.sequence = g.next_sequence.fetch_add(1, std::memory_order_relaxed);
    print.step = g.step.load(std::memory_order_relaxed);
  }
  if (!collective || (mode == CheckMode::Off && words.empty()))
    return g.submit(print, std::forward<Body>(body), async_op);
  return g.submit(
      print,
      [&g, print, mode, words, body = std::forward<Body>(body)] {
        agree(g, print, mode, words);
        body();
      },
      async_op);
}

// issue() for a call whose body moves `buffers` (handed to it, in order). A blocking call hands
// them by reference: it returns only once its body has run, inline or on the worker, so they
// outlive it, and the latency path counts no references (copies cost 0.05 of the 0.27 µs a
// guarded 8-byte all_reduce added to raw MPI on the 2-core test machine). An asynchronous
// call's body holds copies: its buffers outlive a caller that drops them.
template <class Body, class... Buffers>
Work issue_on(const Call& c, const Fingerprint& print, bool async_op, Body&& body,
              const Buffers&... buffers) {
  if (!async_op)
    return issue(
        c, print, true, [&body, &buffers...] { body(buffers...); }, false);
  return issue(
      c, print, true,
      [body = std::forward<Body>(body), ... buffers = buffers] { body(buffers...); }, true);
}

}  // namespace weave::dist::detail
