#pragma once
// Timeline tracing: ops (kernel calls), backward nodes, optimizer steps and collectives (with
// bytes and group) as Chrome trace / Perfetto JSON, one file per rank.
//
//   WEAVE_TRACE=trace.json mpirun -np 2 ./train      # trace.rank0.json, trace.rank1.json
//   weave_trace_merge trace.rank*.json > trace.json   # one timeline
//
// Open the file in https://ui.perfetto.dev or chrome://tracing: one process per rank, one
// track per thread (the main thread's ops and backward, each group's communication worker).
// Timestamps are this machine's monotonic clock, so ranks on one host line up.
//
// Programs can also trace a region: weave::trace::start("t.json") ... weave::trace::stop().
// Off, each instrumented call costs one relaxed atomic load.
#include <atomic>
#include <cstdint>
#include <string>

namespace weave::trace {

namespace detail {
extern std::atomic<bool> on;
int64_t now_ns();
void record(const char* category, std::string name, int64_t start_ns, int64_t end_ns,
            std::string args);
}  // namespace detail

/// True while events are recorded.
inline bool enabled() {
  return detail::on.load(std::memory_order_relaxed);
}
/// Starts recording into `path` (written by stop(); "{rank}" in it becomes the rank).
void start(const std::string& path);
/// Writes the file and stops recording; returns its path ("" if tracing was off). Safe to call
/// twice. dist::finalize calls it, and so does exit when WEAVE_TRACE started the trace.
std::string stop();
/// The process id shown in the trace (the distributed runtime sets its rank) and whether the
/// file name gets a ".rank<r>" suffix (worlds larger than one).
void set_rank(int rank, bool suffix);

/// Records a complete event from construction to destruction when tracing is on. category
/// must outlive the trace (a string literal); make_args, called only when tracing, returns a
/// JSON object's members, e.g. "\"bytes\": 64".
class Scope {
 public:
  Scope(const char* category, const char* name) {
    if (enabled()) begin(category, name);
  }
  /// name is only read when tracing (pass "" otherwise to skip building it).
  Scope(const char* category, std::string name) {
    if (enabled()) begin(category, std::move(name));
  }
  template <class Args>
  Scope(const char* category, const char* name, Args&& make_args) {
    if (enabled()) {
      begin(category, name);
      args_ = make_args();
    }
  }
  ~Scope() {
    if (category_)
      detail::record(category_, std::move(name_), start_, detail::now_ns(), std::move(args_));
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  void begin(const char* category, std::string name) {
    category_ = category;
    name_ = std::move(name);
    start_ = detail::now_ns();
  }
  const char* category_ = nullptr;
  std::string name_;
  int64_t start_ = 0;
  std::string args_;
};

}  // namespace weave::trace
