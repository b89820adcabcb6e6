// One report of a job's errors: every rank that fails sends its message to rank 0 over the
// control communicator; rank 0 (its main thread when it failed too, else its watchdog) waits
// until the reports stop coming, prints each distinct message once with the ranks that raised
// it, and ends the job: with status 1 on every rank when all of them failed (they all reach
// finalize), else by aborting it (the ranks that did not fail may wait inside a collective).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <thread>

#include "weave/distributed/runtime.h"

namespace weave::dist {

namespace detail {

namespace {

struct Fold {
  std::mutex mutex;
  std::map<std::string, std::vector<int>> ranks_of;  // message -> ranks that raised it
  int reported = 0;
  int64_t last_report_ns = 0;
  bool self_failed = false;  // rank 0 itself is ending the job (its main thread decides)
};

Fold& fold() {
  static Fold* f = new Fold;  // never destroyed: the watchdog may outlive statics
  return *f;
}

double wait_s() {
  const char* value = std::getenv("WEAVE_ERROR_WAIT_S");
  const double s = value ? std::atof(value) : 2.0;
  return s > 0 ? s : 2.0;
}

int64_t wait_ns() {
  return static_cast<int64_t>(wait_s() * 1e9);
}

void add(Fold& f, int rank, const std::string& message) {
  std::vector<int>& ranks = f.ranks_of[message];
  if (std::find(ranks.begin(), ranks.end(), rank) != ranks.end()) return;
  ranks.push_back(rank);
  ++f.reported;
  f.last_report_ns = now_ns();
}

void collect(Fold& f) {
  while (auto message = mpi::poll_control(mpi::Control::ErrorReport))
    add(f, message->first, message->second);
}

/// "0-3" for consecutive ranks, else "0, 1, 3".
std::string rank_list(std::vector<int> ranks) {
  std::sort(ranks.begin(), ranks.end());
  if (ranks.size() > 2 && ranks.back() - ranks.front() + 1 == int(ranks.size()))
    return fmt::format("{}-{}", ranks.front(), ranks.back());
  return fmt::format("{}", fmt::join(ranks, ", "));
}

/// Prints the fold once; tells every reporting rank whether the job ends cleanly ("all": every
/// rank failed) or is aborted. Returns whether every rank failed.
bool print_and_answer(Fold& f, int size) {
  std::vector<std::pair<std::vector<int>, std::string>> lines;
  std::vector<bool> failed(size_t(size), false);
  for (auto& [message, ranks] : f.ranks_of) {
    std::sort(ranks.begin(), ranks.end());
    lines.emplace_back(ranks, message);
    for (int rank : ranks) failed[size_t(rank)] = true;
  }
  std::sort(lines.begin(), lines.end());  // by their lowest rank
  std::string text;
  for (const auto& [ranks, message] : lines) {
    const std::string who =
        ranks.size() == 1 ? fmt::format("rank {}", ranks.front())
        : int(ranks.size()) == size
            ? fmt::format("ranks {} (every rank)", rank_list(ranks))
            : fmt::format("ranks {} ({} of {})", rank_list(ranks), ranks.size(), size);
    text += fmt::format("[weave] {}: {}\n", who, message);
  }
  std::vector<int> silent;
  for (int rank = 0; rank < size; ++rank)
    if (!failed[size_t(rank)]) silent.push_back(rank);
  if (!silent.empty())
    text += fmt::format(
        "[weave] {} {} raised no error within {} s of the last report (WEAVE_ERROR_WAIT_S): {} "
        "may wait for the others inside a collective, so the job is aborted\n",
        silent.size() == 1 ? "rank" : "ranks", rank_list(silent), wait_s(),
        silent.size() == 1 ? "it" : "they");
  std::fwrite(text.data(), 1, text.size(), stderr);
  std::fflush(stderr);
  const bool all = silent.empty();
  for (int rank = 1; rank < size; ++rank)
    if (failed[size_t(rank)]) mpi::send_control(rank, mpi::Control::ErrorVerdict, all ? "all" : "");
  return all;
}

[[noreturn]] void leave(bool every_rank_failed) {
  if (every_rank_failed) {
    try {
      finalize();  // every rank is here: the normal shutdown, work left for finalize included
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[weave] rank %d: %s\n", runtime().rank, e.what());
    }
    std::fflush(stderr);
    std::exit(EXIT_FAILURE);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // lets the verdicts leave
  mpi::abort_job(1);
}

[[noreturn]] void end_as_rank_zero(const std::string& message) {
  Runtime& r = runtime();
  Fold& f = fold();
  bool all = false;
  {
    std::lock_guard lock(f.mutex);
    f.self_failed = true;
    add(f, 0, message);
  }
  for (;;) {
    {
      std::lock_guard lock(f.mutex);
      collect(f);
      if (f.reported == r.size || now_ns() - f.last_report_ns >= wait_ns()) {
        all = print_and_answer(f, r.size);
        break;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  leave(all);
}

[[noreturn]] void end_as_other_rank(const std::string& message) {
  Runtime& r = runtime();
  mpi::send_control(0, mpi::Control::ErrorReport, message);
  // Rank 0 answers once the reports stop coming; if it never does (it died), this rank speaks.
  const int64_t deadline = now_ns() + wait_ns() + int64_t(10) * 1000000000;
  while (now_ns() < deadline) {
    if (auto verdict = mpi::poll_control(mpi::Control::ErrorVerdict))
      leave(verdict->second == "all");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::fprintf(stderr, "[weave] rank %d: %s (rank 0 did not collect the job's errors)\n", r.rank,
               message.c_str());
  std::fflush(stderr);
  mpi::abort_job(1);
}

}  // namespace

void serve_error_reports() {
  Runtime& r = runtime();
  if (r.rank != 0 || !r.uses_mpi) return;
  Fold& f = fold();
  std::lock_guard lock(f.mutex);
  if (f.self_failed) return;  // rank 0's main thread collects and decides
  collect(f);
  if (f.reported == 0 || now_ns() - f.last_report_ns < wait_ns()) return;
  print_and_answer(f, r.size);
  leave(false);  // rank 0 raised nothing: the job cannot finish
}

void end_job_with_error(const std::string& message) {
  Runtime& r = runtime();
  if (!r.up || !r.uses_mpi || r.size < 2) {
    std::fprintf(stderr, "[weave] error: %s\n", message.c_str());
    std::fflush(stderr);
    if (r.up) leave(true);
    std::exit(EXIT_FAILURE);
  }
  dump_flight_recorder(message);
  if (r.rank == 0) end_as_rank_zero(message);
  end_as_other_rank(message);
}

}  // namespace detail

void exit_with_error(const std::exception& error) {
  detail::end_job_with_error(error.what());
}

}  // namespace weave::dist
