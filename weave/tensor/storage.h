#pragma once
// Storage: one reference-counted allocation on a device, shared by a tensor and its views.
#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "weave/tensor/device.h"
#include "weave/tensor/shape.h"

namespace weave {

/// What a storage built under nn::DeferredInit will hold once materialized, as the nn floor
/// records it (nn::DeferredValues, nn/deferred.h): this floor only carries the record, and names
/// its parameter in errors.
class DeferredRecord {
 public:
  virtual ~DeferredRecord() = default;
  /// The name its module gave the parameter ("" until registered).
  virtual const std::string& parameter_name() const = 0;
};

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

  /// Room for nbytes that is not allocated yet: released from birth (reading it raises until
  /// allocate_again()). FSDP's gathered buffers of a deferred model start so.
  static std::shared_ptr<Storage> unallocated(size_t nbytes, Device device);
  /// unallocated(), whose values `record` describes: a parameter built under nn::DeferredInit.
  static std::shared_ptr<Storage> deferred(size_t nbytes, Device device,
                                           std::shared_ptr<DeferredRecord> record);
  /// What a deferred storage will hold; null for any other (and once materialization began).
  const std::shared_ptr<DeferredRecord>& deferred_values() const { return deferred_; }
  void clear_deferred() { deferred_.reset(); }

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }
  /// Bumped by every in-place write; autograd compares it against saved versions.
  uint64_t version() const { return version_.load(std::memory_order_relaxed); }
  void bump_version() { version_.fetch_add(1, std::memory_order_relaxed); }

  /// Gives the memory back to the allocator while the Storage (and every view and saved tensor
  /// on it) lives on; reading it raises until allocate_again(). Fully sharded data parallelism
  /// frees a unit's gathered parameters this way between forward and backward.
  void release();
  /// Allocates nbytes() again after release() (contents undefined); nothing if not released.
  void allocate_again();
  bool released() const { return released_; }
  /// Puts the version counter back after a write that refilled released memory with the values
  /// it held (a sharded parameter gathered again for backward): tensors autograd saved from it
  /// stay valid. Only for that case; any other write must keep its bump.
  void restore_version(uint64_t version) { version_.store(version, std::memory_order_relaxed); }

 private:
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  Device device_;
  std::function<void(void*)> deleter_;
  bool owned_ = true;
  bool released_ = false;
  std::shared_ptr<DeferredRecord> deferred_;
  std::atomic<uint64_t> version_{0};
};

/// Host allocator: 64-byte aligned blocks; large blocks are cached by size and reused, so a
/// training loop does not pay for fresh pages (and their faults) on every step.
void* cpu_allocate(size_t nbytes);
void cpu_deallocate(void* ptr, size_t nbytes);
/// Returns every cached host block to the system.
void cpu_empty_cache();

/// What a device's allocator holds:
///
///   reset_peak_memory(kCPU);
///   train_step();
///   fmt::print("peak {} MB\n", memory_stats(kCPU).peak / 1e6);
struct MemoryStats {
  /// Bytes held by live tensors (handed out and not yet given back; cached blocks excluded).
  size_t in_use = 0;
  /// The highest in_use since the last reset_peak_memory (or the start).
  size_t peak = 0;
  /// Blocks handed out and not yet given back.
  size_t allocations = 0;
  /// Bytes the caching allocator keeps free for reuse (not in in_use).
  size_t cached = 0;
  /// This process's resident set now and at its peak (process_memory(): the operating system's
  /// count, tensors of every device's host side, caches, libraries and MPI's buffers included).
  size_t resident = 0;
  size_t resident_peak = 0;
};
/// The allocator's statistics for `device` (the host by default). Raises for a CUDA device in a
/// build without CUDA.
MemoryStats memory_stats(Device device = kCPU);
/// Starts a new peak from the current use (to measure one region of a program); for the host,
/// the resident peak too (reset_resident_peak).
void reset_peak_memory(Device device = kCPU);

namespace detail {
/// The counters behind memory_stats, one per device (thread-safe).
class MemoryCounter {
 public:
  void allocated(size_t bytes);
  void freed(size_t bytes);
  void cached(size_t bytes) { cached_.fetch_add(bytes, std::memory_order_relaxed); }
  void uncached(size_t bytes) { cached_.fetch_sub(bytes, std::memory_order_relaxed); }
  MemoryStats read() const;
  void reset_peak() { peak_.store(in_use_.load(std::memory_order_relaxed)); }

 private:
  std::atomic<size_t> in_use_{0}, peak_{0}, allocations_{0}, cached_{0};
};
}  // namespace detail

}  // namespace weave
