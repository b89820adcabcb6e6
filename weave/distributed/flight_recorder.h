#pragma once
// The flight recorder (internal): with WEAVE_FLIGHT_RECORDER=N each rank keeps its last N calls
// (op, group, sequence number, step, dtype and shape, when issued, started and ended, and whether
// it raised) and writes them when a call times out, when the job is torn down, and at finalize,
// to WEAVE_FLIGHT_RECORDER_FILE (default weave-flight.json) with the rank before the extension:
// weave-flight.rank0.json. Each file is a Chrome trace (the calls as events) with the records
// under "weaveFlight"; tools/trace_merge.cpp merges them and names the first call at which the
// ranks of a group diverged.
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "weave/distributed/fingerprint.h"

namespace weave::dist::detail {

struct FlightRecord {
  int64_t group_id = 0;
  std::vector<int> ranks;
  Fingerprint print;
  int64_t issued_ns = 0;
  std::atomic<int64_t> started_ns{0}, ended_ns{0};
  std::atomic<bool> failed{false};
};

/// Reads WEAVE_FLIGHT_RECORDER (the number of calls kept; unset or 0: off) and
/// WEAVE_FLIGHT_RECORDER_FILE at init; raises for a value that is not a count.
void configure_flight_recorder(int rank);
/// The record of a call just issued, kept among the last N; null when the recorder is off.
std::shared_ptr<FlightRecord> record_flight(int64_t group_id, const std::vector<int>& ranks,
                                            const Fingerprint& print);
/// Writes this rank's records and `why` to its file (nothing when off). Never throws: it runs
/// on the way down.
void dump_flight_recorder(const std::string& why) noexcept;

}  // namespace weave::dist::detail
