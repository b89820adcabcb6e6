// CUDA runtime stand-ins used when weave is built without CUDA: no device is visible and every
// request for one raises weave::Error.
#include "weave/tensor/cuda/device_runtime.h"
#include "weave/tensor/error.h"

namespace weave {

namespace {
[[noreturn]] void no_cuda(const char* what) {
  WEAVE_FAIL(what, "weave was built without CUDA; hint: configure with -DWEAVE_WITH_CUDA=ON");
}
}  // namespace

namespace cuda {
bool is_available() {
  return false;
}
int device_count() {
  return 0;
}
void* allocate(size_t, int) {
  no_cuda("cuda");
}
void deallocate(void*, size_t, int) {}
void empty_cache() {}
weave::detail::MemoryCounter& memory_counter(int) {
  no_cuda("memory_stats");
}
void copy_bytes(void*, Device, const void*, Device, size_t) {
  no_cuda("to");
}
void synchronize(int) {
  no_cuda("cuda");
}
void begin_capture(int) {
  no_cuda("CapturedStep");
}
std::shared_ptr<CapturedGraph> end_capture(int) {
  no_cuda("CapturedStep");
}
void abort_capture(int) {}
void replay(const CapturedGraph&) {
  no_cuda("CapturedStep");
}
bool capturing(int) {
  return false;
}
}  // namespace cuda

}  // namespace weave
