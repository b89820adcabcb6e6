#include "weave/tensor/process_memory.h"

#include <fmt/format.h>
#include <sys/resource.h>

#include <cstdio>
#include <cstring>

#include "weave/tensor/process.h"

namespace weave {

ProcessMemory process_memory() {
  ProcessMemory out;
  if (std::FILE* status = std::fopen("/proc/self/status", "r")) {
    char line[256];
    while (std::fgets(line, sizeof line, status)) {
      unsigned long long kb = 0;
      if (std::sscanf(line, "VmRSS: %llu kB", &kb) == 1) out.resident = size_t(kb) * 1024;
      if (std::sscanf(line, "VmHWM: %llu kB", &kb) == 1) out.resident_peak = size_t(kb) * 1024;
      if (std::sscanf(line, "VmSize: %llu kB", &kb) == 1) out.mapped = size_t(kb) * 1024;
    }
    std::fclose(status);
  }
  rlimit limit{};
  if (getrlimit(RLIMIT_AS, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY)
    out.address_limit = size_t(limit.rlim_cur);
  return out;
}

void reset_resident_peak() {
  // "5" resets the peak resident set to the current one (Linux 4.0 and later).
  if (std::FILE* refs = std::fopen("/proc/self/clear_refs", "w")) {
    std::fputs("5", refs);
    std::fclose(refs);
  }
}

std::string describe_process_memory() {
  const ProcessMemory m = process_memory();
  const auto mb = [](size_t bytes) { return double(bytes) / 1e6; };
  return fmt::format("rank {}: resident {:.0f} MB (peak {:.0f} MB), mapped {:.0f} MB{}",
                     process_place().rank, mb(m.resident), mb(m.resident_peak), mb(m.mapped),
                     m.address_limit
                         ? fmt::format(" of an address-space limit of {:.0f} MB (ulimit -v / "
                                       "prlimit --as)",
                                       mb(m.address_limit))
                         : std::string(", no address-space limit"));
}

}  // namespace weave
