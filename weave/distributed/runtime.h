#pragma once
// The process-wide runtime (internal): init/finalize, the group registry, the watchdog, and
// issue(), through which every front end in collectives.cpp submits its call.
#include <atomic>
#include <mutex>
#include <thread>
#include <vector>

#include "weave/distributed/queue.h"

namespace weave::dist::detail {

struct Runtime {
  bool up = false;
  Backend backend = Backend::MPI;
  bool uses_mpi = false;
  double timeout_s = 300;
  /// timeout_s in nanoseconds, saturated: beyond int64 (about 292 years, or inf) means never.
  int64_t timeout_ns = int64_t{300} * 1000000000;
  bool check = false;
  int rank = 0, size = 1, local_rank = 0;
  Device device = kCPU;
  std::shared_ptr<Group::Impl> world;
  std::mutex groups_mutex;
  std::vector<std::weak_ptr<Group::Impl>> groups;
  std::thread watchdog;
  std::atomic<bool> stop_watchdog{false};
};

/// The process-wide state (never destroyed: worker threads may outlive statics).
Runtime& runtime();
/// runtime(), after checking that init() ran; `op` names the caller in the error.
Runtime& live(const char* op);
/// Reports on stderr that `what` did not complete within the timeout and aborts the whole job
/// (the watchdog's verdict; also used by waits that poll instead of blocking in a call).
[[noreturn]] void tear_down_after_timeout(const std::string& what);

/// A group over `ranks` with its host communicator (null on non-members), registered with the
/// watchdog.
std::shared_ptr<Group::Impl> make_group(std::vector<int> ranks, std::unique_ptr<Communicator> comm);

// Everything one collective call needs from its caller.
struct Call {
  Op op;
  const Group& group;
  const char* name;
  Call(Op o, const Group& g) : op(o), group(g), name(op_name(o)) {}
};

inline Group::Impl& member(const Call& c) {
  live(c.name);
  Group::Impl& g = *c.group.impl();
  WEAVE_CHECK(g.my_rank >= 0, c.name,
              "rank {} is not in group {}; hint: only members may call its collectives",
              runtime().rank, c.group.str());
  return g;
}

// Runs `body` on the group in program order, after the fingerprint check when it is on.
// Point-to-point calls (collective = false) take no sequence number and no check.
template <class Body>
Work issue(const Call& c, Fingerprint print, bool collective, Body&& body, bool async_op) {
  Group::Impl& g = member(c);
  if (collective) print.sequence = g.next_sequence++;
  if (runtime().check && collective)
    return g.submit(
        print,
        [&g, print, body = std::forward<Body>(body)] {
          detail::verify(*g.comm, g.ranks, print);
          body();
        },
        async_op);
  return g.submit(print, std::forward<Body>(body), async_op);
}

}  // namespace weave::dist::detail
