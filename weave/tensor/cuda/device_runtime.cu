// CUDA runtime pieces: device discovery, the caching allocator, streams, byte copies and graph
// capture with private memory pools.
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "weave/tensor/cuda/common.cuh"
#include "weave/tensor/cuda/device_runtime.h"

namespace weave::cuda {

namespace {

constexpr int kMaxDevices = 64;

using Blocks = std::multimap<size_t, void*>;  // free blocks by rounded size

// A graph's memory: what its capture allocated or freed. Its free blocks are reused only by the
// capture itself (which runs in the order it was queued, as replays do) and go back to the
// device's cache when the graph is destroyed.
struct GraphPool {
  Blocks free_blocks;
  bool graph_alive = true;
};

// Blocks are rounded up (512 B below 1 MiB, else 2 MiB) and kept per device by size. A freed
// block is reused only by later work on weave's stream, which is ordered after its last use.
struct DeviceCache {
  std::mutex mutex;
  Blocks free_blocks;
  // Every block a graph pool owns (in use or free) and its pool.
  std::unordered_map<void*, std::shared_ptr<GraphPool>> pooled;
  std::shared_ptr<GraphPool> capture_pool;  // the capture under way, if any
  std::thread::id capturing_thread;
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

/// The pool of the capture this thread runs on the device (null when none).
GraphPool* capture_pool_of_this_thread(DeviceCache& c) {
  return c.capture_pool && c.capturing_thread == std::this_thread::get_id() ? c.capture_pool.get()
                                                                            : nullptr;
}

/// Takes a free block of `size` from `blocks` (null when none).
void* take(Blocks& blocks, size_t size) {
  auto it = blocks.find(size);
  if (it == blocks.end()) return nullptr;
  void* ptr = it->second;
  blocks.erase(it);
  return ptr;
}

/// A fresh block from CUDA; outside a capture a failure gives the cache back and tries again.
void* fresh_block(size_t size, size_t nbytes, int device, bool in_capture) {
  DeviceGuard guard(device);
  void* ptr = nullptr;
  if (cudaMalloc(&ptr, size) == cudaSuccess) return ptr;
  cudaGetLastError();
  WEAVE_CHECK(!in_capture, "cuda",
              "cudaMalloc of {} bytes on cuda:{} failed while a CUDA graph captured; hint: "
              "capture a smaller step, or free cached memory (empty_cache) before capturing",
              nbytes, device);
  release_cached(device);  // give cached blocks back and try once more
  const cudaError_t status = cudaMalloc(&ptr, size);
  WEAVE_CHECK(status == cudaSuccess, "cuda",
              "cudaMalloc of {} bytes on cuda:{} failed: {}; hint: smaller batches, or free "
              "tensors you no longer need",
              nbytes, device, detail::call_error(status));
  return ptr;
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
  std::shared_ptr<GraphPool> pool;
  {
    std::lock_guard lock(c.mutex);
    GraphPool* capturing = capture_pool_of_this_thread(c);
    void* ptr = take(capturing ? capturing->free_blocks : c.free_blocks, size);
    if (ptr != nullptr) {
      c.counter.uncached(size);
      c.counter.allocated(size);
      return ptr;
    }
    if (capturing) pool = c.capture_pool;
  }
  void* ptr = fresh_block(size, nbytes, device, pool != nullptr);
  std::lock_guard lock(c.mutex);
  if (pool) c.pooled.emplace(ptr, pool);
  c.counter.allocated(size);
  return ptr;
}

void deallocate(void* ptr, size_t nbytes, int device) {
  if (ptr == nullptr) return;
  DeviceCache& c = cache(device);
  std::lock_guard lock(c.mutex);
  const size_t size = round_size(nbytes);
  c.counter.freed(size);
  c.counter.cached(size);
  // A block the capturing thread frees may still be read by the captured work before that
  // point: the graph keeps it, as it keeps what it allocated.
  if (GraphPool* capturing = capture_pool_of_this_thread(c)) {
    c.pooled.emplace(ptr, c.capture_pool);
    capturing->free_blocks.emplace(size, ptr);
    return;
  }
  auto owner = c.pooled.find(ptr);
  if (owner != c.pooled.end() && owner->second->graph_alive) {
    owner->second->free_blocks.emplace(size, ptr);
    return;
  }
  if (owner != c.pooled.end()) c.pooled.erase(owner);  // its graph is gone: an ordinary block
  c.free_blocks.emplace(size, ptr);
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

namespace {
/// Raises when the host would wait for `device` while a graph captures there: CUDA would
/// invalidate the capture, and the value read would not exist yet.
void check_not_capturing(int device, const char* op) {
  WEAVE_CHECK(!capturing(device), op,
              "the host would wait for cuda:{} while a CUDA graph captures its work (a value read "
              "on the host: .item(), .cpu(), to_vector, a host-side check); hint: keep host reads "
              "out of the captured step: return the tensor from the step and read it after the "
              "call",
              device);
}
}  // namespace

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t nbytes) {
  if (nbytes == 0) return;
  const int device = dst_device.is_cuda() ? dst_device.index : src_device.index;
  check_not_capturing(device, "to");
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
  check_not_capturing(device, "cuda");
  DeviceGuard guard(device);
  WEAVE_CHECK_CALL(cudaStreamSynchronize(stream(device)), "cuda");
}

// Graph capture.

class CapturedGraph {
 public:
  CapturedGraph(int device, cudaGraph_t graph, cudaGraphExec_t exec,
                std::shared_ptr<GraphPool> pool)
      : device_(device), graph_(graph), exec_(exec), pool_(std::move(pool)) {}
  ~CapturedGraph();
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  void launch() const {
    DeviceGuard guard(device_);
    WEAVE_CHECK_CALL(cudaGraphLaunch(exec_, stream(device_)), "CapturedStep");
  }

 private:
  int device_;
  cudaGraph_t graph_;
  cudaGraphExec_t exec_;
  std::shared_ptr<GraphPool> pool_;
};

namespace {
/// The graph is gone (or never was): its free blocks become ordinary cached blocks, and those
/// still in use become ordinary when freed.
void release_pool(int device, const std::shared_ptr<GraphPool>& pool) {
  DeviceCache& c = cache(device);
  std::lock_guard lock(c.mutex);
  pool->graph_alive = false;
  for (auto& [size, ptr] : pool->free_blocks) {
    c.pooled.erase(ptr);
    c.free_blocks.emplace(size, ptr);
  }
  pool->free_blocks.clear();
}

/// Ends the device's capture in the allocator: its pool, no longer filled.
std::shared_ptr<GraphPool> take_capture_pool(int device) {
  DeviceCache& c = cache(device);
  std::lock_guard lock(c.mutex);
  return std::move(c.capture_pool);
}
}  // namespace

CapturedGraph::~CapturedGraph() {
  DeviceGuard guard(device_);
  cudaStreamSynchronize(stream(device_));  // a replay may still run
  cudaGraphExecDestroy(exec_);
  cudaGraphDestroy(graph_);
  release_pool(device_, pool_);
}

void begin_capture(int device) {
  check_device(device, "CapturedStep");
  synchronize(device);  // eager work queued before the capture runs before it
  DeviceCache& c = cache(device);
  {
    std::lock_guard lock(c.mutex);
    WEAVE_CHECK(c.capture_pool == nullptr, "CapturedStep",
                "a CUDA graph already captures on cuda:{}; hint: capture one step at a time",
                device);
    c.capture_pool = std::make_shared<GraphPool>();
    c.capturing_thread = std::this_thread::get_id();
  }
  DeviceGuard guard(device);
  // Relaxed: the allocator may still take fresh blocks from cudaMalloc while capturing.
  const cudaError_t status = cudaStreamBeginCapture(stream(device), cudaStreamCaptureModeRelaxed);
  if (status != cudaSuccess) release_pool(device, take_capture_pool(device));
  WEAVE_CHECK_CALL(status, "CapturedStep");
}

std::shared_ptr<CapturedGraph> end_capture(int device) {
  DeviceGuard guard(device);
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(stream(device), &graph);
  std::shared_ptr<GraphPool> pool = take_capture_pool(device);
  cudaGraphExec_t exec = nullptr;
  cudaError_t status = ended;
  if (status == cudaSuccess) status = cudaGraphInstantiate(&exec, graph, 0);
  if (status != cudaSuccess) {
    cudaGetLastError();
    if (graph != nullptr) cudaGraphDestroy(graph);
    if (pool) release_pool(device, pool);
    WEAVE_FAIL("CapturedStep",
               "CUDA could not capture the step on cuda:{}: {}; hint: a captured step may only "
               "queue work on weave's stream (no host reads, no other streams or devices)",
               device, detail::call_error(status));
  }
  return std::make_shared<CapturedGraph>(device, graph, exec, std::move(pool));
}

void abort_capture(int device) {
  DeviceGuard guard(device);
  cudaGraph_t graph = nullptr;
  cudaStreamEndCapture(stream(device), &graph);
  cudaGetLastError();
  if (graph != nullptr) cudaGraphDestroy(graph);
  if (std::shared_ptr<GraphPool> pool = take_capture_pool(device)) release_pool(device, pool);
}

void replay(const CapturedGraph& graph) {
  graph.launch();
}

bool capturing(int device) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  DeviceGuard guard(device);
  WEAVE_CHECK_CALL(cudaStreamIsCapturing(stream(device), &status), "cuda");
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace weave::cuda
