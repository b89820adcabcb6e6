#pragma once
// Each group's communication queue (internal): collectives run in program order, inline on
// the caller's thread when blocking with nothing queued, else on the group's worker thread.
//
// Who owns what. The runtime (runtime.h) owns the world's Group::Impl and registers the others
// weakly; every Group handle owns its Impl, and an Impl owns its communicators, its queue of
// Tasks and its worker thread (joined in stop()). A Task owns the closure that moves the bytes
// and shares its Work::State with the caller's Work handle; the closure owns (captures) the
// tensors it reads and writes, so an asynchronous call's buffers outlive a caller that drops
// them. An isend's Work is also kept by the group (track_send) until it is seen complete.
//
// Which thread runs what. One caller thread issues on a group at a time (`issuer`; a second
// raises). Tasks run one at a time per group (`busy`), on the caller's thread (blocking, queue
// empty) or on the worker; Work::State is finished by whichever ran it, under its mutex. The
// watchdog thread only reads `running_since` and, under `mutex`, `running`.
#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "weave/distributed/agreement_board.h"
#include "weave/distributed/communicator.h"
#include "weave/distributed/distributed.h"
#include "weave/distributed/fingerprint.h"
#include "weave/distributed/flight_recorder.h"
#include "weave/tensor/trace.h"

namespace weave::dist {

struct Work::State {
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
  // A non-blocking send (isend): `done` means posted; complete once `pending` is done too.
  std::unique_ptr<detail::PendingSend> pending;
  Tensor keep_alive;  // the send's buffer

  void finish(std::exception_ptr e) {
    {
      std::lock_guard lock(mutex);
      done = true;
      error = e;
    }
    cv.notify_all();
  }
};

namespace detail {

/// Monotonic clock in nanoseconds (the watchdog's time base).
int64_t now_ns();
/// The same clock at its last tick (a few ms behind now_ns, never ahead): when a call started,
/// for the watchdog and the roll call, whose limits are seconds. A fifth of now_ns's cost on a
/// VM's clock (2.7 ns against 20.7), which every blocking call pays.
int64_t coarse_now_ns();

struct Task {
  std::function<void()> run;
  std::shared_ptr<Work::State> state;
  Fingerprint print;
  std::shared_ptr<FlightRecord> record;  // null unless the flight recorder is on
};

}  // namespace detail

struct Group::Impl {
  std::vector<int> ranks;
  int my_rank = -1;
  std::unique_ptr<detail::Communicator> comm;         // host (MPI or local); null on non-members
  std::unique_ptr<detail::Communicator> device_comm;  // NCCL, for CUDA tensors; null otherwise
  /// Where the guard's rounds meet when the ranks share a machine (null: over `comm`).
  std::unique_ptr<detail::AgreementBoard> board;

  /// Where a tensor's bytes travel: NCCL for CUDA tensors when there is one, else the host.
  detail::Communicator* route(const Tensor& t) const {
    return t.device().is_cuda() && device_comm ? device_comm.get() : comm.get();
  }
  bool finished = false;  // finalize() ran: the communicators are gone
  /// The same on every rank: new_group runs on every rank in one order (the world is 0).
  int64_t id = 0;
  std::atomic<int64_t> step{-1};           // dist::set_step's number, copied into each call
  std::atomic<uint64_t> next_sequence{0};  // collectives issued (caller side, program order)
  std::atomic<std::thread::id> issuer{};   // the thread inside issue() now, if any
  /// Agreement steps that raised on this rank (a mismatch, or a peer's failed call): the same
  /// count on every rank, since every rank of the group raises at the same call.
  std::atomic<uint64_t> disagreements{0};

  std::mutex sends_mutex;
  std::vector<Work> sends_in_flight;  // isend's Works not yet seen complete

  // Keeps an isend's Work until it is seen complete (dropping the ones already done).
  void track_send(const Work& work) {
    std::lock_guard lock(sends_mutex);
    std::erase_if(sends_in_flight, [](const Work& w) { return w.is_completed(); });
    sends_in_flight.push_back(work);
  }
  // Waits for every isend still in flight on this group.
  void wait_sends() {
    std::vector<Work> in_flight;
    {
      std::lock_guard lock(sends_mutex);
      in_flight.swap(sends_in_flight);
    }
    for (const Work& w : in_flight) w.wait();
  }

  std::mutex mutex;
  std::condition_variable cv;
  std::deque<detail::Task> tasks;
  bool busy = false;  // an op of this group is running (inline or on the worker)
  bool stopping = false;
  std::thread worker;

  // Read by the watchdog: when the running op started (0: none) and what it is.
  std::atomic<int64_t> running_since{0};
  detail::Fingerprint running;                           // guarded by mutex
  std::shared_ptr<detail::FlightRecord> running_record;  // guarded by mutex
  // The last call this rank issued on the group and when (0: none): a roll call's answer.
  detail::Fingerprint last_issued;  // guarded by mutex
  int64_t last_issued_ns = 0;       // guarded by mutex

  ~Impl() { stop(); }

  void stop() {
    {
      std::lock_guard lock(mutex);
      stopping = true;
    }
    cv.notify_all();
    if (worker.joinable()) worker.join();
  }

  // Marks the op started (caller holds the lock); the watchdog formats its description only
  // if it ever has to report it, so the latency path formats nothing.
  void start_running(const detail::Fingerprint& print, std::shared_ptr<detail::FlightRecord> record,
                     int64_t now) {
    busy = true;
    running = print;
    running_since.store(now, std::memory_order_release);
    if (record) record->started_ns.store(now);
    running_record = std::move(record);
  }
  void finish_running(bool failed) {
    running_since.store(0, std::memory_order_release);
    {
      std::lock_guard lock(mutex);
      busy = false;
      if (running_record) {
        running_record->failed.store(failed);
        running_record->ended_ns.store(detail::now_ns());
        running_record.reset();
      }
    }
    cv.notify_all();
    heartbeat();  // a call completed: the rank makes progress, on whichever axis it is
  }

  void worker_loop() {
    for (;;) {
      detail::Task task;
      {
        std::unique_lock lock(mutex);
        cv.wait(lock, [&] { return !busy && (stopping || !tasks.empty()); });
        if (tasks.empty()) return;  // stopping, queue drained
        task = std::move(tasks.front());
        tasks.pop_front();
        start_running(task.print, std::move(task.record), detail::now_ns());
      }
      std::exception_ptr error;
      try {
        run_traced(task.print, task.run);
      } catch (...) {
        error = std::current_exception();
      }
      finish_running(error != nullptr);
      task.state->finish(error);
    }
  }

  // Runs an op's body as a "collective" event of the trace (weave/tensor/trace.h).
  template <class Body>
  void run_traced(const detail::Fingerprint& print, Body& body) {
    const trace::Scope trace_scope("collective", detail::op_name(static_cast<detail::Op>(print.op)),
                                   [&] { return detail::trace_args(print, ranks); });
    body();
  }

  // Issues one op in program order: inline when blocking and nothing is queued (no thread
  // hand-off, no allocation on the latency path), else on the worker thread.
  template <class Body>
  Work submit(const detail::Fingerprint& print, Body&& body, bool async_op) {
    auto record = detail::record_flight(id, ranks, print);
    if (!async_op) {
      std::unique_lock lock(mutex);
      // One clock read for both on the latency path; exact only for a flight record's times.
      const int64_t now = record ? detail::now_ns() : detail::coarse_now_ns();
      note_issued(print, now);
      if (tasks.empty() && !busy) {
        start_running(print, std::move(record), now);
        lock.unlock();
        struct Finish {
          Impl* self;
          int unwinding = std::uncaught_exceptions();
          ~Finish() { self->finish_running(std::uncaught_exceptions() > unwinding); }
        } finish{this};
        run_traced(print, body);
        return Work();
      }
    }
    auto state = std::make_shared<Work::State>();
    {
      std::lock_guard lock(mutex);
      if (async_op) note_issued(print, detail::now_ns());
      tasks.push_back(
          {std::function<void()>(std::forward<Body>(body)), state, print, std::move(record)});
      if (!worker.joinable()) worker = std::thread([this] { worker_loop(); });
    }
    cv.notify_all();
    Work work(state);
    if (!async_op) work.wait();
    return work;
  }

  // Caller holds the lock.
  void note_issued(const detail::Fingerprint& print, int64_t now) {
    last_issued = print;
    last_issued_ns = now;
  }

  // Waits until everything issued so far has run.
  void drain() {
    std::unique_lock lock(mutex);
    cv.wait(lock, [&] { return tasks.empty() && !busy; });
  }
};

}  // namespace weave::dist
