// Stand-ins used when weave is built without CUDA: every entry point raises weave::Error.
#include "ops/kernel_backends.h"
#include "tensor/cuda_runtime.h"

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
void copy_bytes(void*, Device, const void*, Device, size_t) {
  no_cuda("to");
}
void synchronize(int) {
  no_cuda("cuda");
}
}  // namespace cuda

namespace kernels::cuda {
void unary(UnaryOp, const Tensor&, const Tensor&) {
  no_cuda("unary");
}
void unary_backward(UnaryOp, const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  no_cuda("unary");
}
void binary(BinaryOp, const Tensor&, const Tensor&, const Tensor&) {
  no_cuda("binary");
}
void where(const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  no_cuda("where");
}
void copy(const Tensor&, const Tensor&) {
  no_cuda("copy");
}
void fill(const Tensor&, double) {
  no_cuda("fill");
}
void reduce(ReduceOp, const Tensor&, int64_t, int64_t, int64_t, const Tensor&) {
  no_cuda("reduce");
}
void matmul(const Tensor&, const Tensor&, const Tensor&) {
  no_cuda("matmul");
}
void index_select(const Tensor&, int64_t, int64_t, int64_t, const Tensor&, const Tensor&) {
  no_cuda("index_select");
}
void index_add(const Tensor&, int64_t, int64_t, int64_t, const Tensor&, const Tensor&) {
  no_cuda("index_add");
}
}  // namespace kernels::cuda

}  // namespace weave
