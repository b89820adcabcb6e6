#pragma once
// The small slice of the CUDA runtime the tensor layer needs: device_runtime.cu when weave is
// built with CUDA, no_cuda.cpp (which raises weave::Error) otherwise.
#include <cstddef>

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

}  // namespace weave::cuda
