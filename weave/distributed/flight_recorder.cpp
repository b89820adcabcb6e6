// The flight recorder's ring of calls and its file.
#include "weave/distributed/flight_recorder.h"

#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>

#include "weave/distributed/queue.h"
#include "weave/tensor/dtype.h"
#include "weave/tensor/error.h"

namespace weave::dist::detail {

namespace {

struct Recorder {
  std::atomic<size_t> capacity{0};
  std::mutex mutex;
  std::vector<std::shared_ptr<FlightRecord>> ring;  // the oldest at `next` once full
  size_t next = 0;
  std::string path;
  int rank = 0;
};

Recorder& recorder() {
  static auto* r = new Recorder();  // never destroyed: the watchdog may dump at exit
  return *r;
}

// weave-flight.json -> weave-flight.rank3.json (as WEAVE_TRACE names its files).
std::string rank_file(const std::string& path, int rank) {
  const std::filesystem::path p(path);
  const std::string ext = p.has_extension() ? p.extension().string() : ".json";
  return (p.parent_path() / (p.stem().string() + ".rank" + std::to_string(rank) + ext)).string();
}

const char* state_of(const FlightRecord& r) {
  if (r.ended_ns.load() != 0) return r.failed.load() ? "raised" : "completed";
  return r.started_ns.load() != 0 ? "running" : "queued";
}

nlohmann::json describe_record(const FlightRecord& r) {
  const Fingerprint& f = r.print;
  std::vector<int64_t> shape(f.dims, f.dims + std::max(f.ndim, 0));
  nlohmann::json j = {{"group", r.group_id},
                      {"ranks", r.ranks},
                      {"op", op_name(static_cast<Op>(f.op))},
                      {"call", describe(f)},
                      {"sequence", f.sequence},
                      {"step", f.step},
                      {"state", state_of(r)},
                      {"issued_us", r.issued_ns / 1000}};
  if (f.ndim >= 0) {
    j["dtype"] = dtype_name(static_cast<DType>(f.dtype));
    j["shape"] = shape;
  }
  if (const int64_t s = r.started_ns.load()) j["started_us"] = s / 1000;
  if (const int64_t e = r.ended_ns.load()) j["ended_us"] = e / 1000;
  return j;
}

// A call as a trace event: a span once it ran, else an instant at its issue.
nlohmann::json event_of(const nlohmann::json& call, int rank) {
  nlohmann::json e = {{"name", call["call"]},
                      {"cat", "flight"},
                      {"pid", rank},
                      {"tid", call["group"]},
                      {"args", {{"state", call["state"]}}}};
  if (call.contains("started_us") && call.contains("ended_us")) {
    e["ph"] = "X";
    e["ts"] = call["started_us"];
    e["dur"] = call["ended_us"].get<int64_t>() - call["started_us"].get<int64_t>();
  } else {
    e["ph"] = "i";
    e["s"] = "t";
    e["ts"] = call["issued_us"];
  }
  return e;
}

}  // namespace

void configure_flight_recorder(int rank) {
  Recorder& r = recorder();
  std::lock_guard lock(r.mutex);
  r.rank = rank;
  r.ring.clear();
  r.next = 0;
  const char* count = std::getenv("WEAVE_FLIGHT_RECORDER");
  size_t capacity = 0;
  if (count != nullptr && *count != '\0') {
    char* end = nullptr;
    const long long n = std::strtoll(count, &end, 10);
    WEAVE_CHECK(end != count && *end == '\0' && n >= 0 && n <= 10000000, "init",
                "WEAVE_FLIGHT_RECORDER='{}' is not a number of calls to keep (0 to 10000000)",
                count);
    capacity = size_t(n);
  }
  const char* file = std::getenv("WEAVE_FLIGHT_RECORDER_FILE");
  r.path = rank_file(file != nullptr && *file != '\0' ? file : "weave-flight.json", rank);
  r.capacity.store(capacity);
}

std::shared_ptr<FlightRecord> record_flight(int64_t group_id, const std::vector<int>& ranks,
                                            const Fingerprint& print) {
  Recorder& r = recorder();
  const size_t capacity = r.capacity.load(std::memory_order_relaxed);
  if (capacity == 0) return nullptr;
  auto record = std::make_shared<FlightRecord>();
  record->group_id = group_id;
  record->ranks = ranks;
  record->print = print;
  record->issued_ns = now_ns();
  std::lock_guard lock(r.mutex);
  if (r.ring.size() < capacity) {
    r.ring.push_back(record);
  } else {
    r.ring[r.next] = record;
    r.next = (r.next + 1) % capacity;
  }
  return record;
}

namespace {

// text written to a fresh file beside path (mkstemp: created exclusively, never through a link
// another user planted there), renamed over path (a link at path is replaced, not followed).
// On failure errno says why, and nothing is left behind.
bool write_beside(const std::string& path, const std::string& text) {
  std::string temp = path + ".tmp-XXXXXX";
  const int fd = ::mkstemp(temp.data());
  if (fd < 0) return false;
  for (size_t done = 0; done < text.size();) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int saved = errno;
      ::close(fd);
      ::unlink(temp.c_str());
      errno = saved;
      return false;
    }
    done += size_t(n);
  }
  if (::close(fd) == 0 && ::rename(temp.c_str(), path.c_str()) == 0) return true;
  const int saved = errno;
  ::unlink(temp.c_str());
  errno = saved;
  return false;
}

}  // namespace

void dump_flight_recorder(const std::string& why) noexcept {
  try {
    Recorder& r = recorder();
    if (r.capacity.load() == 0) return;
    nlohmann::json calls = nlohmann::json::array(), events = nlohmann::json::array();
    {
      std::lock_guard lock(r.mutex);
      for (size_t i = 0; i < r.ring.size(); ++i)
        calls.push_back(describe_record(*r.ring[(r.next + i) % r.ring.size()]));
    }
    for (const auto& call : calls) events.push_back(event_of(call, r.rank));
    const nlohmann::json file = {
        {"displayTimeUnit", "ms"},
        {"traceEvents", events},
        {"weaveFlight", {{"rank", r.rank}, {"why", why}, {"calls", calls}}}};
    if (write_beside(r.path, file.dump(1) + "\n"))
      std::fprintf(stderr, "[weave] rank %d: flight recorder: %zu calls written to %s\n", r.rank,
                   calls.size(), r.path.c_str());
    else
      std::fprintf(stderr, "[weave] rank %d: flight recorder: cannot write %s: %s\n", r.rank,
                   r.path.c_str(), std::strerror(errno));
  } catch (...) {  // on the way down: a recorder that cannot write must not hide the real error
  }
}

}  // namespace weave::dist::detail
