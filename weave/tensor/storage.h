#pragma once
// Storage: one reference-counted allocation on a device, shared by a tensor and its views.
#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>

#include "weave/tensor/device.h"

namespace weave {

/// A block of device memory. Views of one tensor share one Storage, and therefore one
/// version counter: an in-place write through any view is visible to autograd's checks.
class Storage {
 public:
  /// Allocates nbytes on device from weave's caching allocators.
  Storage(size_t nbytes, Device device);
  /// Wraps memory owned elsewhere; deleter (may be empty) runs when the storage dies.
  Storage(void* data, size_t nbytes, Device device, std::function<void(void*)> deleter);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }
  /// Bumped by every in-place write; autograd compares it against saved versions.
  uint64_t version() const { return version_.load(std::memory_order_relaxed); }
  void bump_version() { version_.fetch_add(1, std::memory_order_relaxed); }

 private:
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  Device device_;
  std::function<void(void*)> deleter_;
  bool owned_ = true;
  std::atomic<uint64_t> version_{0};
};

/// Host allocator: 64-byte aligned blocks; large blocks are cached by size and reused, so a
/// training loop does not pay for fresh pages (and their faults) on every step.
void* cpu_allocate(size_t nbytes);
void cpu_deallocate(void* ptr, size_t nbytes);
/// Returns every cached host block to the system.
void cpu_empty_cache();

/// Bytes of host memory held by live tensors (what the allocator has handed out and not yet
/// taken back, cached blocks excluded), now and at the peak since the last reset.
struct MemoryStats {
  size_t in_use = 0;
  size_t peak = 0;
};
MemoryStats cpu_memory_stats();
/// Starts a new peak from the current use (to measure one region of a program).
void cpu_reset_peak_memory();

}  // namespace weave
