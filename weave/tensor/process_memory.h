#pragma once
// This process's memory as the operating system counts it, beside the allocator's tensor bytes
// (memory_stats): what a scheduler's limit or the machine's memory meets is the resident set
// and the mapped address space, which hold more than tensors (the allocator's cache, libraries,
// MPI's buffers and shared-memory segments).
//
//   ProcessMemory m = process_memory();
//   fmt::print("resident peak {} MB\n", m.resident_peak / 1e6);
//   WEAVE_CHECK(ok, "op", "... ({})", describe_process_memory());   // for errors that may be
//   memory
#include <cstddef>
#include <string>

namespace weave {

struct ProcessMemory {
  /// Resident set now and at its peak (Linux: VmRSS and VmHWM of /proc/self/status).
  size_t resident = 0;
  size_t resident_peak = 0;
  /// Address space mapped (VmSize): what an address-space limit (ulimit -v, prlimit --as) caps.
  size_t mapped = 0;
  /// That limit (getrlimit RLIMIT_AS); 0: none.
  size_t address_limit = 0;
};

/// The largest tensor peak (memory_stats(device).peak) and resident peak over a group of ranks,
/// each with the rank holding it (dist::max_memory_stats): a memory budget must fit the worst.
struct MemoryPeaks {
  size_t tensor_peak = 0;
  int tensor_rank = 0;
  size_t resident_peak = 0;
  int resident_rank = 0;
};

/// Read now (zeros where the system does not say).
ProcessMemory process_memory();
/// Starts a new resident peak from the current resident set (Linux: /proc/self/clear_refs),
/// as reset_peak_memory does for tensors; a no-op where the system cannot.
void reset_resident_peak();
/// "rank 2: resident 1637 MB (peak 2030 MB), mapped 2710 MB of an address-space limit of 2048
/// MB (ulimit -v / prlimit --as)", for errors that may be memory.
std::string describe_process_memory();

}  // namespace weave
