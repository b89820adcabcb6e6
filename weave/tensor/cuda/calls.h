#pragma once
// What CUDA-runtime code needs in any translation unit (.cu or a backend's .cpp): the status
// overloads behind WEAVE_CHECK_CALL for cudaError_t, and the current-device guard.
#include <cuda_runtime.h>

#include <string>

#include "weave/tensor/error.h"

namespace weave::detail {
inline bool call_succeeded(cudaError_t status) {
  return status == cudaSuccess;
}
inline std::string call_error(cudaError_t status) {
  return fmt::format("{} (CUDA {})", cudaGetErrorString(status), cudaGetErrorName(status));
}
}  // namespace weave::detail

namespace weave::cuda {

/// Makes `device` current for its lifetime and restores the caller's device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : device_(device) {
    WEAVE_CHECK_CALL(cudaGetDevice(&previous_), "cuda");
    if (device_ != previous_) WEAVE_CHECK_CALL(cudaSetDevice(device_), "cuda");
  }
  // Every launch takes a guard: restoring only what changed keeps a runtime call off each one.
  ~DeviceGuard() {
    if (device_ != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int device_ = 0, previous_ = 0;
};

}  // namespace weave::cuda
