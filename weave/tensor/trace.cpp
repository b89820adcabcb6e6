// Event buffers per thread, merged and written as Chrome trace JSON at stop().
#include "weave/tensor/trace.h"

#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <vector>

#include "weave/tensor/error.h"

namespace weave::trace {

namespace detail {

std::atomic<bool> on{false};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

namespace {

struct Event {
  const char* category;
  std::string name;
  int64_t start_ns, end_ns;
  std::string args;
};

struct ThreadBuffer {
  int tid = 0;
  std::mutex mutex;  // uncontended but for stop()
  std::vector<Event> events;
};

struct State {
  std::mutex mutex;
  std::vector<std::shared_ptr<ThreadBuffer>> buffers;  // every thread's, kept after it exits
  std::string path;
  int rank = 0;
  bool suffix = false;
  int next_tid = 0;
};

State& state() {
  static State* s = new State;  // never destroyed: threads may record during exit
  return *s;
}

ThreadBuffer& my_buffer() {
  thread_local std::shared_ptr<ThreadBuffer> buffer = [] {
    auto b = std::make_shared<ThreadBuffer>();
    std::lock_guard lock(state().mutex);
    b->tid = state().next_tid++;
    state().buffers.push_back(b);
    return b;
  }();
  return *buffer;
}

std::string escaped(const char* text) {
  std::string out;
  for (const char* c = text; *c; ++c) {
    if (*c == '"' || *c == '\\') out += '\\';
    if (static_cast<unsigned char>(*c) >= 0x20) out += *c;
  }
  return out;
}

// WEAVE_TRACE starts tracing before main and writes the file at exit.
struct FromEnvironment {
  FromEnvironment() {
    const char* path = std::getenv("WEAVE_TRACE");
    if (path == nullptr || *path == '\0') return;
    start(path);
    std::atexit([] { stop(); });
  }
} from_environment;

}  // namespace

void record(const char* category, std::string name, int64_t start_ns, int64_t end_ns,
            std::string args) {
  ThreadBuffer& buffer = my_buffer();
  std::lock_guard lock(buffer.mutex);
  buffer.events.push_back({category, std::move(name), start_ns, end_ns, std::move(args)});
}

}  // namespace detail

using namespace detail;

void start(const std::string& path) {
  WEAVE_CHECK(!path.empty(), "trace", "the trace file name is empty");
  {
    std::lock_guard lock(state().mutex);
    state().path = path;
    for (auto& b : state().buffers) {
      std::lock_guard buffer_lock(b->mutex);
      b->events.clear();
    }
  }
  on.store(true);
}

void set_rank(int rank, bool suffix) {
  std::lock_guard lock(state().mutex);
  state().rank = rank;
  state().suffix = suffix;
}

std::string stop() {
  if (!on.exchange(false)) return "";
  std::lock_guard lock(state().mutex);
  State& s = state();
  std::string path = s.path;
  const std::string rank = std::to_string(s.rank);
  if (auto at = path.find("{rank}"); at != std::string::npos) {
    path.replace(at, 6, rank);
  } else if (s.suffix) {
    const auto dot = path.rfind(".json");
    path = dot != std::string::npos && dot + 5 == path.size()
               ? path.substr(0, dot) + ".rank" + rank + ".json"
               : path + ".rank" + rank;
  }
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    std::fprintf(stderr, "[weave] cannot write the trace to %s\n", path.c_str());
    return "";
  }
  std::fprintf(f, "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n");
  std::fprintf(f,
               "{\"ph\": \"M\", \"name\": \"process_name\", \"pid\": %d, \"args\": {\"name\": "
               "\"rank %d\"}}",
               s.rank, s.rank);
  for (const auto& buffer : s.buffers) {
    std::lock_guard buffer_lock(buffer->mutex);
    for (const Event& e : buffer->events) {
      std::string line = fmt::format(
          ",\n{{\"ph\": \"X\", \"cat\": \"{}\", \"name\": \"{}\", \"pid\": {}, \"tid\": {}, "
          "\"ts\": {:.3f}, \"dur\": {:.3f}",
          escaped(e.category), escaped(e.name.c_str()), s.rank, buffer->tid,
          double(e.start_ns) / 1e3, double(e.end_ns - e.start_ns) / 1e3);
      if (!e.args.empty()) line += ", \"args\": {" + e.args + "}";
      line += "}";
      std::fputs(line.c_str(), f);
    }
    buffer->events.clear();
  }
  std::fprintf(f, "\n]}\n");
  std::fclose(f);
  return path;
}

}  // namespace weave::trace
