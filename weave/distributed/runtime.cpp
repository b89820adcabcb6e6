// init/finalize, the world, and the watchdog that turns a hung collective into a clear job-wide
// failure (groups.cpp makes the other groups).
#include "weave/distributed/runtime.h"

#include "weave/distributed/agreement.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>

#include "weave/tensor/cuda/device_runtime.h"
#include "weave/tensor/process.h"

namespace weave::dist {

namespace detail {

Runtime& runtime() {
  static Runtime* r = new Runtime;  // never destroyed: worker threads may outlive statics
  return *r;
}

Runtime& live(const char* op) {
  Runtime& r = runtime();
  WEAVE_CHECK(r.up, op,
              "the distributed module is not initialized; hint: call weave::dist::init() first");
  return r;
}

std::shared_ptr<Group::Impl> make_group(std::vector<int> ranks,
                                        std::unique_ptr<Communicator> comm) {
  Runtime& r = runtime();
  auto impl = std::make_shared<Group::Impl>();
  impl->ranks = std::move(ranks);
  auto it = std::find(impl->ranks.begin(), impl->ranks.end(), r.rank);
  impl->my_rank = it == impl->ranks.end() ? -1 : static_cast<int>(it - impl->ranks.begin());
  impl->comm = std::move(comm);
  if (impl->comm)  // members, together
    impl->board = AgreementBoard::connect(*impl->comm, mpi::cores_shared());
  impl->id = r.next_group_id++;
  std::lock_guard lock(r.groups_mutex);
  r.groups.push_back(impl);
  return impl;
}

void report(const std::string& what) {
  std::fprintf(stderr, "[weave] rank %d: %s\n", runtime().rank, what.c_str());
  std::fflush(stderr);
}

void tear_down(const std::string& why) {
  dump_flight_recorder(why);
  report(fmt::format("{}; tearing the job down", why));
  if (runtime().uses_mpi) detail::mpi::abort_job(1);
  std::_Exit(1);
}

void tear_down_after_timeout(const std::string& what) {
  tear_down(
      fmt::format("{} did not complete within {} s (WEAVE_TIMEOUT_S); a rank of the group "
                  "probably skipped it or is stuck",
                  what, runtime().timeout_s));
}

void agree(Group::Impl& g, const Fingerprint& print, CheckMode mode, std::span<int64_t> words) {
  try {
    if (mode == CheckMode::Guard) {
      guard(*g.comm, g.board.get(), g.ranks, print, words);
      return;
    }
    if (mode == CheckMode::Full) verify(*g.comm, g.ranks, print);
    max_words(*g.comm, g.board.get(), words);
  } catch (...) {
    g.disagreements.fetch_add(1, std::memory_order_relaxed);
    throw;
  }
}

void report_failure(const Call& c) noexcept {
  try {
    if (c.op == Op::Send || c.op == Op::Recv) return;  // their check travels with the message
    Fingerprint print;
    print.op = static_cast<int32_t>(c.op);
    print.rank = runtime().rank;
    print.failed = 1;
    // Takes the call's turn with nothing to run: the agreement step raises here too (the flag
    // is set), which the catch below drops, since this rank's own error is the one to report.
    issue(
        c, print, true, [] {}, false);
  } catch (...) {  // not initialized, not a member, a finished group: nobody waits for this rank
  }
}

void abort_if_peers_wait(const std::string& why) {
  Runtime& r = runtime();
  if (!r.up || !r.uses_mpi || r.size < 2) return;
  std::string error = last_error_message();
  if (why.find(error) != std::string::npos) error.clear();  // already told
  std::fprintf(stderr,
               "[weave] rank %d: %s; the other ranks may be waiting for this one, so it aborts "
               "the job instead of finalizing%s%s\n",
               r.rank, why.c_str(),
               error.empty() ? "" : ". Last error on this rank: ", error.c_str());
  std::fflush(stderr);
  dump_flight_recorder(why);
  detail::mpi::abort_job(1);
}

}  // namespace detail

using namespace detail;

void heartbeat() {
  Runtime& r = runtime();
  if (!r.up || r.heartbeat_ns <= 0) return;
  const int64_t now = now_ns();
  int64_t last = r.last_heartbeat_ns.load(std::memory_order_relaxed);
  if (now - last < r.heartbeat_ns ||
      !r.last_heartbeat_ns.compare_exchange_strong(last, now, std::memory_order_relaxed))
    return;
  // One short line in one write: weave-run recognizes it and keeps it out of the job's output.
  const std::string line = fmt::format("[weave-run heartbeat] rank {}\n", r.rank);
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

KeepAlive::KeepAlive() {
  runtime().keep_alive_scopes.fetch_add(1);
}
KeepAlive::~KeepAlive() {
  runtime().keep_alive_scopes.fetch_sub(1);
}

namespace {

double env_double(const char* name, double fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  double d = std::strtod(v, &end);
  WEAVE_CHECK(end != v && *end == '\0' && d > 0, "init", "{}='{}' is not a positive number", name,
              v);
  return d;
}

constexpr const char* kUnevenHint =
    "hint: every rank must run the same number of steps: give each rank as many batches as the "
    "others (DistributedSampler pads or drops to equal shares), or run the training loop in "
    "parallel::join(...), which shadows the missing steps";
// The waiting call came from a backward: the likelier cause is a communicating node the other
// rank's backward never ran.
constexpr const char* kBackwardHint =
    "hint: the waiting call was issued from backward, so the likely cause is a collective inside "
    "a backward that not every rank ran: a custom autograd::Function that communicates must "
    "declare `static constexpr bool communicates = true` (every rank's backward then runs it, "
    "even where its loss does not use the output); otherwise every rank must run the same number "
    "of steps (DistributedSampler, or parallel::join(...))";

// A rank's leaving notice: [groups, then (id, collectives issued, step) per group].
std::vector<int64_t> leaving_notice(const std::vector<std::shared_ptr<Group::Impl>>& groups) {
  std::vector<int64_t> notice = {0};
  for (const auto& g : groups) {
    if (g->my_rank < 0) continue;
    notice.insert(notice.end(),
                  {g->id, static_cast<int64_t>(g->next_sequence.load()), g->step.load()});
    ++notice[0];
  }
  return notice;
}

struct Leaver {
  int rank;
  std::vector<int64_t> notice;
  int64_t arrived_ns = 0;
};

// A point-to-point call whose partner left: the leaver completed its own sends and receives
// before it said so, so a call still running a probe interval after the notice never will.
void check_partner_left(const Leaver& leaver, Group::Impl& group, const Fingerprint& running) {
  const std::vector<int> peers = partners_of(group, running);
  if (std::find(peers.begin(), peers.end(), leaver.rank) == peers.end()) return;
  if (now_ns() - std::max(leaver.arrived_ns, group.running_since.load()) < kProbeAfterNs) return;
  const std::string ranks = fmt::format("[{}]", fmt::join(group.ranks, ", "));
  const char* hint = running.from_backward ? kBackwardHint : kUnevenHint;
  report(
      fmt::format("rank {} called finalize() while this rank waits for it in {} on group {}; "
                  "{}; tearing the job down",
                  leaver.rank, describe(running), ranks, hint));
  detail::mpi::report_waiting(
      leaver.rank, fmt::format("rank {} waits for this rank in {} on group {}, which this rank "
                               "left without its part; {}",
                               runtime().rank, describe(running), ranks, hint));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // lets the leaver report too
  detail::mpi::abort_job(1);
}

// When `leaver` left without ever issuing the collective `group` is running, that collective
// can never complete: reports it here and to the leaver, and tears the job down.
void check_waits_for(const Leaver& leaver, Group::Impl& group) {
  if (std::find(group.ranks.begin(), group.ranks.end(), leaver.rank) == group.ranks.end()) return;
  Fingerprint running;
  {
    std::lock_guard lock(group.mutex);
    running = group.running;
  }
  const auto op = static_cast<Op>(running.op);
  if (op == Op::Send || op == Op::Recv) return check_partner_left(leaver, group, running);
  for (int64_t i = 0; i < leaver.notice[0]; ++i) {
    const int64_t* entry = &leaver.notice[1 + 3 * i];
    if (entry[0] != group.id) continue;
    const auto issued = static_cast<uint64_t>(entry[1]);
    if (running.sequence < issued) return;  // the leaver took part; it is completing
    const std::string left_after = entry[2] >= 0 ? fmt::format("after {} steps", entry[2] + 1)
                                                 : fmt::format("after {} collectives", issued);
    const std::string ranks = fmt::format("[{}]", fmt::join(group.ranks, ", "));
    const int me = runtime().rank;
    const char* hint = running.from_backward ? kBackwardHint : kUnevenHint;
    report(
        fmt::format("rank {} called finalize() {} on group {}, while this rank waits for it in "
                    "{}; {}; tearing the job down",
                    leaver.rank, left_after, ranks, describe(running), hint));
    detail::mpi::report_waiting(
        leaver.rank, fmt::format("rank {} waits for this rank in {} on group {}, which this rank "
                                 "never issued: it called finalize() {} on that group; {}",
                                 me, describe(running), ranks, left_after, hint));
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // lets the leaver report too
    detail::mpi::abort_job(1);
  }
}

void watchdog_loop() {
  Runtime& r = runtime();
  const int64_t limit = r.timeout_ns;
  std::vector<Leaver> leavers;
  while (!r.stop_watchdog.load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (r.uses_mpi)
      while (auto notice = detail::mpi::poll_leaving()) {
        leavers.push_back({notice->first, std::move(notice->second), now_ns()});
        r.leaving_polled.fetch_add(1);
      }
    // A peer that timed out asks what this rank last issued; if this rank waits in a call of
    // that group too, it tells its own story now, before the peer tears the job down.
    const std::vector<int64_t> asked = r.uses_mpi ? serve_roll_calls() : std::vector<int64_t>{};
    serve_error_reports();
    std::shared_ptr<Group::Impl> timed_out;
    std::vector<std::shared_ptr<Group::Impl>> probed;  // a point-to-point call, waiting long
    bool by_peer = false;
    bool stalled = false;  // a call has run longer than a beat interval: no beat on its behalf
    {
      std::lock_guard lock(r.groups_mutex);
      for (auto& weak : r.groups) {
        auto group = weak.lock();
        if (!group) continue;
        int64_t since = group->running_since.load(std::memory_order_acquire);
        if (since == 0) continue;
        stalled = stalled || now_ns() - since >= r.heartbeat_ns;
        if (now_ns() - since >= kProbeAfterNs) probed.push_back(group);
        for (const Leaver& leaver : leavers) check_waits_for(leaver, *group);
        by_peer = std::find(asked.begin(), asked.end(), group->id) != asked.end();
        if (now_ns() - since < limit && !by_peer) continue;
        by_peer = by_peer && now_ns() - since < limit;
        timed_out = group;
        break;
      }
    }
    if (timed_out) time_out(*timed_out, by_peer);
    for (const auto& group : probed)
      if (const std::string story = find_deadlock(*group); !story.empty())
        time_out(*group, false, story);
    if (r.keep_alive_scopes.load() > 0 && !stalled) heartbeat();
  }
}

// An exception that escapes main (std::terminate) or an exit() while the job runs would leave
// the other ranks waiting: both abort the job with this rank's story instead.
std::terminate_handler previous_terminate = nullptr;

void terminate_with_report() {
  std::string what = "an uncaught exception";
  if (auto e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& error) {
      what = fmt::format("uncaught exception: {}", error.what());
    } catch (...) {
    }
  }
  abort_if_peers_wait(what);
  // No peer waits (a world of one): the same report as a multi-rank job's, and status 1 rather
  // than the C++ runtime's "terminate called ..." and SIGABRT, which read as a crash.
  if (runtime().up) {
    std::fprintf(stderr, "[weave] rank %d: %s\n", runtime().rank, what.c_str());
    std::fflush(stderr);
    dump_flight_recorder(what);
    std::_Exit(EXIT_FAILURE);
  }
  if (previous_terminate) previous_terminate();
  std::abort();
}

void exit_without_finalize() {
  abort_if_peers_wait("the process is exiting (exit() or a return from main) without finalize()");
}

}  // namespace

InitGuard::~InitGuard() {
  const Runtime& r = runtime();
  if (std::uncaught_exceptions() > unwinding_at_start_ && r.up && r.uses_mpi && r.size > 1) {
    // The others may wait for this rank inside a collective: instead of finalizing, the job
    // ends with every failing rank's error printed once.
    const std::string error = last_error_message();
    end_job_with_error("an exception is leaving the scope of its InitGuard" +
                       (error.empty() ? std::string() : ": " + error));
  }
  const int rank = initialized() ? runtime().rank : -1;
  const int size = initialized() ? runtime().size : 1;
  try {
    finalize();
  } catch (const std::exception& e) {
    // A destructor cannot raise: the process exits non-zero instead, so a launcher (weave-run,
    // a scheduler) never counts a lost checkpoint as a success.
    std::fprintf(stderr, "[weave] rank %d: %s\n", rank, e.what());
    std::fflush(stderr);
    // Every rank fails here (agreed at finalize); mpirun kills the rest when the first exits.
    if (size > 1) std::this_thread::sleep_for(std::chrono::seconds(1));
    std::exit(EXIT_FAILURE);
  }
}

void init(Backend backend, InitOptions options) {
  Runtime& r = runtime();
  WEAVE_CHECK(!r.up, "init", "already initialized; hint: call finalize() first");
  r.backend = backend;
  r.timeout_s = options.timeout_s > 0 ? options.timeout_s : env_double("WEAVE_TIMEOUT_S", 300);
  r.timeout_ns = r.timeout_s >= 9.2e9 ? std::numeric_limits<int64_t>::max()
                                      : static_cast<int64_t>(r.timeout_s * 1e9);
  if (options.check) check_is_mode(*options.check, "init");
  r.check = options.check ? *options.check : check_mode_from_env();
  r.heartbeat_ns = static_cast<int64_t>(std::min(env_double("WEAVE_HEARTBEAT_S", 0), 1e9) * 1e9);
  r.last_heartbeat_ns = 0;
  r.next_group_id = 0;
  r.leaving_polled = 0;
  std::unique_ptr<Communicator> comm;
  r.uses_mpi = detail::mpi::launched();
  if (r.uses_mpi) {
    comm = detail::mpi::init_world();
    r.local_rank = detail::mpi::local_rank();
  } else {
    comm = make_local_communicator();
    r.local_rank = 0;
  }
  r.rank = comm->rank();
  r.size = comm->size();
  configure_flight_recorder(r.rank);
  r.sent_to = std::make_unique<std::atomic<int64_t>[]>(size_t(r.size));
  r.received_from = std::make_unique<std::atomic<int64_t>[]>(size_t(r.size));
  // the checks add messages of their own: every rank must send the same ones
  agree_on_check_mode(*comm, nullptr, r.check, "init",
                      "give every rank the same WEAVE_CHECK_COLLECTIVES");
  r.device = kCPU;
  if (backend == Backend::NCCL) {
    WEAVE_CHECK(detail::nccl::available(), "init",
                "weave was built without NCCL; hint: configure with -DWEAVE_WITH_CUDA=ON "
                "-DWEAVE_WITH_NCCL=ON, or use Backend::MPI");
    WEAVE_CHECK(cuda::is_available(), "init",
                "the NCCL backend needs a CUDA device; none is visible{}",
                cuda::device_count() == 0 ? " (or weave was built without CUDA)" : "");
    std::vector<int> devices = options.cuda_devices;
    if (devices.empty())
      for (int d = 0; d < cuda::device_count(); ++d) devices.push_back(d);
    for (int d : devices)
      WEAVE_CHECK(d >= 0 && d < cuda::device_count(), "init",
                  "cuda_devices lists cuda:{}, but {} are visible", d, cuda::device_count());
    r.device = Device::cuda(devices[r.local_rank % devices.size()]);
  }
  std::vector<int> all(r.size);
  std::iota(all.begin(), all.end(), 0);
  r.world = make_group(all, std::move(comm));
  if (backend == Backend::NCCL)
    r.world->device_comm = detail::nccl::init_world(*r.world->comm, r.device.index);
  trace::set_rank(r.rank, r.size > 1);
  set_process_place({r.rank, r.size});
  static const bool handlers_installed = [] {
    previous_terminate = std::set_terminate(terminate_with_report);
    std::atexit(exit_without_finalize);
    return true;
  }();
  (void)handlers_installed;
  r.up = true;
  r.stop_watchdog = false;
  r.watchdog = std::thread(watchdog_loop);
}

bool initialized() {
  return runtime().up;
}

void at_finalize(std::function<void()> fn) {
  live("at_finalize").finalize_hooks.push_back(std::move(fn));
}

void finalize() {
  Runtime& r = runtime();
  if (!r.up) return;
  // A hook's failure (a checkpoint that could not be committed) is raised once the session is
  // down: every hook still runs, and the job still leaves in step.
  std::string hook_errors;
  for (auto hooks = std::exchange(r.finalize_hooks, {}); !hooks.empty(); hooks.pop_back()) {
    try {
      hooks.back()();
    } catch (const std::exception& e) {
      hook_errors += (hook_errors.empty() ? "" : "; ") + std::string(e.what());
    }
  }
  {
    std::vector<std::shared_ptr<Group::Impl>> groups;
    {
      std::lock_guard lock(r.groups_mutex);
      for (auto& weak : r.groups)
        if (auto g = weak.lock()) groups.push_back(g);
    }
    for (auto& g : groups) g->wait_sends();
    for (auto& g : groups) g->drain();  // the watchdog still guards this
    // A peer still waiting in a collective this rank never issued learns it from this notice
    // at once (the watchdog's check_waits_for), instead of at the timeout.
    if (r.uses_mpi && r.size > 1) detail::mpi::announce_leaving(leaving_notice(groups));
    for (auto& g : groups) {
      g->stop();
      g->finished = true;
      g->device_comm.reset();
      g->comm.reset();
    }
  }
  // MPI_Finalize waits for every rank; one still inside a collective (a skipped call, a rank
  // that left early) would make it wait forever. The farewell barrier waits only so long.
  if (r.uses_mpi && r.size > 1) {
    std::string waiting;
    if (!detail::mpi::farewell(r.timeout_ns, &waiting)) {
      if (!waiting.empty()) tear_down(fmt::format("finalize(): {}", waiting));
      tear_down_after_timeout("finalize (waiting for every rank to reach it)");
    }
  }
  r.stop_watchdog = true;
  if (r.watchdog.joinable()) r.watchdog.join();
  if (r.uses_mpi && r.size > 1) detail::mpi::finish_leaving(r.leaving_polled.load());
  {
    std::lock_guard lock(r.groups_mutex);
    r.groups.clear();
  }
  r.world.reset();
  trace::stop();  // while the rank is known; a WEAVE_TRACE run writes its file here
  if (r.uses_mpi) detail::mpi::finalize();
  set_process_place({});
  r.up = false;
  WEAVE_CHECK(hook_errors.empty(), "finalize",
              "work left for finalize() failed: {}; hint: call parallel::wait_for_checkpoint() "
              "before finalize() to handle a failed background save where it happens",
              hook_errors);
}

int rank() {
  return live("rank").rank;
}
int world_size() {
  return live("world_size").size;
}
int local_rank() {
  return live("local_rank").local_rank;
}
Backend backend() {
  return live("backend").backend;
}
Device device() {
  return live("device").device;
}

Group world() {
  return Group(live("world").world);
}

}  // namespace weave::dist
