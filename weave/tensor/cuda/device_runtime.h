#pragma once
// The small slice of the CUDA runtime the tensor layer needs: device_runtime.cu when weave is
// built with CUDA, no_cuda.cpp (which raises weave::Error) otherwise.
#include <cstddef>
#include <memory>

#include "weave/tensor/device.h"
#include "weave/tensor/storage.h"

namespace weave::cuda {

/// True when weave was built with CUDA and at least one device is visible.
bool is_available();
/// Number of visible CUDA devices (0 without CUDA).
int device_count();
/// Caching device allocator (blocks are reused by size; cudaMalloc only on a miss).
void* allocate(size_t nbytes, int device);
void deallocate(void* ptr, size_t nbytes, int device);
/// Frees every cached device block.
void empty_cache();
/// The allocator's counters for a device (memory_stats(Device::cuda(device)) reads them).
weave::detail::MemoryCounter& memory_counter(int device);
/// Copies nbytes between any two devices (host included) and waits for the copy.
void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t nbytes);
/// Waits for all work on the device's weave stream.
void synchronize(int device);
/// The device's weave stream as a cudaStream_t (for backends that order work after it).
void* stream_handle(int device);

/// A CUDA graph made from the work one thread queued on a device's weave stream, with the
/// private memory pool its kernels read and write: blocks allocated while it captured (and
/// blocks freed then) stay reserved for it until it is destroyed, so a replay finds every
/// address where the capture left it and no other tensor is ever given one.
class CapturedGraph;
/// Starts capturing the work this thread queues on `device`'s weave stream (no work runs until
/// a replay). One capture per device at a time; raises if one is under way.
void begin_capture(int device);
/// Ends the capture begun on `device` and instantiates the graph. Raises when the capture
/// failed (an operation CUDA cannot capture), naming CUDA's reason; the pool is released then.
std::shared_ptr<CapturedGraph> end_capture(int device);
/// Abandons a capture under way (after an exception): its work is dropped, its pool released.
void abort_capture(int device);
/// Queues one run of the graph on its device's weave stream (no host wait).
void replay(const CapturedGraph& graph);
/// True while a graph captures on `device` (from any thread): the host cannot wait for that
/// stream or read device memory until the capture ends.
bool capturing(int device);

}  // namespace weave::cuda
