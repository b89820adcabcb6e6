#include "weave/tensor/storage.h"

#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <new>

#include "weave/tensor/cuda/device_runtime.h"
#include "weave/tensor/error.h"
#include "weave/tensor/process_memory.h"

namespace weave {

namespace {

constexpr size_t kAlignment = 64;
// Blocks below this size go straight to malloc, which already recycles small chunks well.
constexpr size_t kCacheMinBytes = size_t{1} << 16;
constexpr size_t kCacheLimitBytes = size_t{1} << 31;

struct HostCache {
  std::mutex mutex;
  std::multimap<size_t, void*> free_blocks;
  size_t cached_bytes = 0;

  ~HostCache() { release_all(); }
  void release_all() {
    for (auto& [size, ptr] : free_blocks) std::free(ptr);
    free_blocks.clear();
    cached_bytes = 0;
  }
};

HostCache& host_cache() {
  static HostCache* cache = new HostCache;  // never destroyed: tensors may outlive statics
  return *cache;
}

detail::MemoryCounter& host_counter() {
  static detail::MemoryCounter* counter = new detail::MemoryCounter;  // as the cache
  return *counter;
}

size_t round_up(size_t n) {
  return (std::max<size_t>(n, 1) + kAlignment - 1) / kAlignment * kAlignment;
}

}  // namespace

void* cpu_allocate(size_t nbytes) {
  size_t size = round_up(nbytes);
  host_counter().allocated(size);
  if (size >= kCacheMinBytes) {
    HostCache& cache = host_cache();
    std::lock_guard lock(cache.mutex);
    auto it = cache.free_blocks.find(size);
    if (it != cache.free_blocks.end()) {
      void* ptr = it->second;
      cache.free_blocks.erase(it);
      cache.cached_bytes -= size;
      host_counter().uncached(size);
      return ptr;
    }
  }
  void* ptr = std::aligned_alloc(kAlignment, size);
  if (ptr == nullptr) {  // the cached blocks go back to the system, and one more try
    cpu_empty_cache();
    ptr = std::aligned_alloc(kAlignment, size);
  }
  if (ptr == nullptr) host_counter().freed(size);
  WEAVE_CHECK(ptr != nullptr, "alloc",
              "out of host memory allocating {:.1f} MB with {:.1f} MB of tensors in use ({}); "
              "hint: more ranks to shard over (FSDP), a smaller batch, activation "
              "checkpointing, or a higher limit",
              double(nbytes) / 1e6, double(host_counter().read().in_use) / 1e6,
              describe_process_memory());
  return ptr;
}

void cpu_deallocate(void* ptr, size_t nbytes) {
  if (ptr == nullptr) return;
  size_t size = round_up(nbytes);
  host_counter().freed(size);
  if (size >= kCacheMinBytes) {
    HostCache& cache = host_cache();
    std::lock_guard lock(cache.mutex);
    if (cache.cached_bytes + size <= kCacheLimitBytes) {
      cache.free_blocks.emplace(size, ptr);
      cache.cached_bytes += size;
      host_counter().cached(size);
      return;
    }
  }
  std::free(ptr);
}

void cpu_empty_cache() {
  HostCache& cache = host_cache();
  std::lock_guard lock(cache.mutex);
  host_counter().uncached(cache.cached_bytes);
  cache.release_all();
}

void detail::MemoryCounter::allocated(size_t bytes) {
  allocations_.fetch_add(1, std::memory_order_relaxed);
  const size_t now = in_use_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  size_t peak = peak_.load(std::memory_order_relaxed);
  while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

void detail::MemoryCounter::freed(size_t bytes) {
  allocations_.fetch_sub(1, std::memory_order_relaxed);
  in_use_.fetch_sub(bytes, std::memory_order_relaxed);
}

MemoryStats detail::MemoryCounter::read() const {
  return {in_use_.load(std::memory_order_relaxed), peak_.load(std::memory_order_relaxed),
          allocations_.load(std::memory_order_relaxed), cached_.load(std::memory_order_relaxed)};
}

MemoryStats memory_stats(Device device) {
  MemoryStats stats =
      device.is_cpu() ? host_counter().read() : cuda::memory_counter(device.index).read();
  const ProcessMemory process = process_memory();
  stats.resident = process.resident;
  stats.resident_peak = process.resident_peak;
  return stats;
}

void reset_peak_memory(Device device) {
  if (device.is_cpu()) {
    host_counter().reset_peak();
    reset_resident_peak();
  } else
    cuda::memory_counter(device.index).reset_peak();
}

Storage::Storage(size_t nbytes, Device device) : nbytes_(nbytes), device_(device) {
  data_ = device.is_cpu() ? cpu_allocate(nbytes) : cuda::allocate(nbytes, device.index);
}

Storage::Storage(void* data, size_t nbytes, Device device, std::function<void(void*)> deleter)
    : data_(data), nbytes_(nbytes), device_(device), deleter_(std::move(deleter)), owned_(false) {}

std::shared_ptr<Storage> Storage::unallocated(size_t nbytes, Device device) {
  auto storage = std::make_shared<Storage>(nullptr, nbytes, device, nullptr);
  storage->owned_ = true;  // weave allocates it, at allocate_again()
  storage->released_ = true;
  return storage;
}

std::shared_ptr<Storage> Storage::deferred(size_t nbytes, Device device,
                                           std::shared_ptr<DeferredRecord> record) {
  auto storage = unallocated(nbytes, device);
  storage->deferred_ = std::move(record);
  return storage;
}

void Storage::release() {
  WEAVE_CHECK(owned_, "Storage::release", "only memory weave allocated can be released");
  if (released_) return;
  if (device_.is_cpu())
    cpu_deallocate(data_, nbytes_);
  else
    cuda::deallocate(data_, nbytes_, device_.index);
  data_ = nullptr;
  released_ = true;
}

void Storage::allocate_again() {
  if (!released_) return;
  data_ = device_.is_cpu() ? cpu_allocate(nbytes_) : cuda::allocate(nbytes_, device_.index);
  released_ = false;
}

Storage::~Storage() {
  if (released_) return;
  if (!owned_) {
    if (deleter_) deleter_(data_);
  } else if (device_.is_cpu()) {
    cpu_deallocate(data_, nbytes_);
  } else {
    cuda::deallocate(data_, nbytes_, device_.index);
  }
}

}  // namespace weave
