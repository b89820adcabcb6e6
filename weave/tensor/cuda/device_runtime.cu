// CUDA runtime pieces: device discovery, the caching allocator, streams and byte copies.
#include <map>
#include <mutex>
#include <vector>

#include "weave/tensor/cuda/common.cuh"
#include "weave/tensor/cuda/device_runtime.h"

namespace weave::cuda {

namespace {

constexpr int kMaxDevices = 64;

// Blocks are rounded up (512 B below 1 MiB, else 2 MiB) and kept per device by size. A freed
// block is reused only by later work on weave's stream, which is ordered after its last use.
struct DeviceCache {
  std::mutex mutex;
  std::multimap<size_t, void*> free_blocks;
  weave::detail::MemoryCounter counter;
};

DeviceCache& cache(int device) {
  static DeviceCache* caches = new DeviceCache[kMaxDevices];  // never destroyed
  return caches[device];
}

size_t round_size(size_t n) {
  if (n < (size_t{1} << 20)) return std::max<size_t>(512, (n + 511) / 512 * 512);
  return (n + (size_t{2} << 20) - 1) / (size_t{2} << 20) * (size_t{2} << 20);
}

void release_cached(int device) {
  DeviceCache& c = cache(device);
  std::lock_guard lock(c.mutex);
  DeviceGuard guard(device);
  for (auto& [size, ptr] : c.free_blocks) {
    cudaFree(ptr);
    c.counter.uncached(size);
  }
  c.free_blocks.clear();
}

void check_device(int device, const char* op) {
  const int count = device_count();
  WEAVE_CHECK(device >= 0 && device < count && device < kMaxDevices, op,
              "cuda:{} does not exist; {} CUDA device(s) are visible", device, count);
}

}  // namespace

int device_count() {
  static const int count = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();  // clear the sticky "no device" error
      return 0;
    }
    return n;
  }();
  return count;
}

bool is_available() {
  return device_count() > 0;
}

void* allocate(size_t nbytes, int device) {
  check_device(device, "cuda");
  if (nbytes == 0) return nullptr;
  const size_t size = round_size(nbytes);
  DeviceCache& c = cache(device);
  {
    std::lock_guard lock(c.mutex);
    auto it = c.free_blocks.find(size);
    if (it != c.free_blocks.end()) {
      void* ptr = it->second;
      c.free_blocks.erase(it);
      c.counter.uncached(size);
      c.counter.allocated(size);
      return ptr;
    }
  }
  DeviceGuard guard(device);
  void* ptr = nullptr;
  if (cudaMalloc(&ptr, size) != cudaSuccess) {
    cudaGetLastError();
    release_cached(device);  // give cached blocks back and try once more
    const cudaError_t status = cudaMalloc(&ptr, size);
    WEAVE_CHECK(status == cudaSuccess, "cuda",
                "cudaMalloc of {} bytes on cuda:{} failed: {}; hint: smaller batches, or free "
                "tensors you no longer need",
                nbytes, device, detail::call_error(status));
  }
  c.counter.allocated(size);
  return ptr;
}

void deallocate(void* ptr, size_t nbytes, int device) {
  if (ptr == nullptr) return;
  DeviceCache& c = cache(device);
  std::lock_guard lock(c.mutex);
  const size_t size = round_size(nbytes);
  c.free_blocks.emplace(size, ptr);
  c.counter.freed(size);
  c.counter.cached(size);
}

weave::detail::MemoryCounter& memory_counter(int device) {
  check_device(device, "memory_stats");
  return cache(device).counter;
}

void empty_cache() {
  for (int d = 0; d < device_count(); ++d) {
    synchronize(d);
    release_cached(d);
  }
}

cudaStream_t stream(int device) {
  // Created once per device; later calls read it without a lock.
  static std::once_flag created[kMaxDevices];
  static cudaStream_t streams[kMaxDevices] = {};
  check_device(device, "cuda");
  std::call_once(created[device], [device] {
    DeviceGuard guard(device);
    WEAVE_CHECK_CALL(cudaStreamCreateWithFlags(&streams[device], cudaStreamNonBlocking), "cuda");
  });
  return streams[device];
}

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t nbytes) {
  if (nbytes == 0) return;
  const int device = dst_device.is_cuda() ? dst_device.index : src_device.index;
  DeviceGuard guard(device);
  cudaStream_t s = stream(device);
  if (dst_device.is_cuda() && src_device.is_cuda() && dst_device.index != src_device.index) {
    synchronize(src_device.index);  // the source's producers run on its own stream
    WEAVE_CHECK_CALL(cudaMemcpyPeerAsync(dst, dst_device.index, src, src_device.index, nbytes, s),
                     "to");
  } else {
    WEAVE_CHECK_CALL(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, s), "to");
  }
  WEAVE_CHECK_CALL(cudaStreamSynchronize(s), "to");
}

const cudaDeviceProp& device_properties(int device) {
  static std::once_flag read[kMaxDevices];
  static cudaDeviceProp properties[kMaxDevices];
  check_device(device, "cuda");
  std::call_once(read[device], [device] {
    WEAVE_CHECK_CALL(cudaGetDeviceProperties(&properties[device], device), "cuda");
  });
  return properties[device];
}

void* stream_handle(int device) {
  return stream(device);
}

void synchronize(int device) {
  DeviceGuard guard(device);
  WEAVE_CHECK_CALL(cudaStreamSynchronize(stream(device)), "cuda");
}

}  // namespace weave::cuda
