// Without cuDNN, weave's own tensor-core kernels run all attention (flash_attention.cu).
#include <cstdlib>
#include <cstring>

#include "weave/kernels/backends.h"

namespace weave::kernels::cuda {

namespace {

bool declined() {
  const char* kernel = std::getenv("WEAVE_ATTENTION_KERNEL");
  WEAVE_CHECK(!kernel || std::strcmp(kernel, "cudnn") != 0, "scaled_dot_product_attention",
              "WEAVE_ATTENTION_KERNEL=cudnn, but weave was built without cuDNN; hint: configure "
              "with WEAVE_WITH_CUDNN=ON where cudnn.h and libcudnn are found");
  return false;
}

}  // namespace

bool cudnn_attention(const Tensor&, const Tensor&, const Tensor&, const AttentionParams&,
                     const Tensor&, const Tensor&) {
  return declined();
}

bool cudnn_attention_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                              const AttentionParams&, const Tensor&, const Tensor&, const Tensor&,
                              const Tensor&, const Tensor&) {
  return declined();
}

}  // namespace weave::kernels::cuda
