// Rotary position embeddings on CUDA: a grid-stride loop over every (row, head, pair) and the
// passed-through dims; angles in float64 (the op is bound by memory, and float32 angles lose
// three digits at positions in the thousands).
#include <cuda_runtime.h>

#include "weave/kernels/backends.h"
#include "weave/tensor/cuda/common.cuh"

namespace weave::kernels::cuda {

namespace {

struct RotaryShape {
  int64_t seq, heads, dim, pairs;
  int64_t xs[3], os[3], ps[2];  // strides of x, out (batch, position, head) and positions
  bool interleaved, inverse;
};

template <class T>
__global__ void rotary_kernel(const T* x, const int64_t* positions, const double* frequencies,
                              T* out, RotaryShape s, int64_t total) {
  const int64_t per_head = s.dim - s.pairs;  // pairs turned plus dims copied
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t slot = e % per_head, head_row = e / per_head;
    const int64_t h = head_row % s.heads, bt = head_row / s.heads;
    const int64_t t = bt % s.seq, b = bt / s.seq;
    const T* xi = x + b * s.xs[0] + t * s.xs[1] + h * s.xs[2];
    T* oi = out + b * s.os[0] + t * s.os[1] + h * s.os[2];
    if (slot >= s.pairs) {  // a dim past the rotary ones: copied
      const int64_t j = slot + s.pairs;
      oi[j] = xi[j];
      continue;
    }
    const int64_t first = s.interleaved ? 2 * slot : slot;
    const int64_t second = s.interleaved ? 2 * slot + 1 : slot + s.pairs;
    double sine, cosine;
    sincos(double(positions[b * s.ps[0] + t * s.ps[1]]) * frequencies[slot], &sine, &cosine);
    if (s.inverse) sine = -sine;
    const T a = xi[first], c = xi[second];
    oi[first] = T(a * T(cosine) - c * T(sine));
    oi[second] = T(c * T(cosine) + a * T(sine));
  }
}

}  // namespace

void rotary(const Tensor& x, const Tensor& positions, const Tensor& frequencies, bool interleaved,
            bool inverse, const Tensor& out) {
  RotaryShape s{x.size(1), x.size(2),   x.size(3), frequencies.numel(), {}, {},
                {},        interleaved, inverse};
  for (int d = 0; d < 3; ++d) {
    s.xs[d] = x.strides()[d];
    s.os[d] = out.strides()[d];
  }
  s.ps[0] = positions.strides()[0];
  s.ps[1] = positions.strides()[1];
  const int64_t total = x.size(0) * s.seq * s.heads * (s.dim - s.pairs);
  if (total == 0) return;
  DeviceGuard guard(x.device().index);
  visit_floating(x.dtype(), "rotary_embedding", [&](auto tag) {
    using T = typename decltype(tag)::type;
    rotary_kernel<T>
        <<<grid_stride_blocks(total), kThreads, 0, weave::cuda::stream(x.device().index)>>>(
            static_cast<const T*>(x.data_ptr()), positions.data<int64_t>(),
            frequencies.data<double>(), static_cast<T*>(out.data_ptr()), s, total);
  });
  check_launch("rotary_embedding");
}

}  // namespace weave::kernels::cuda
