#pragma once
// Eigen, included the one way weave includes it. GCC 12 reports -Wmaybe-uninitialized inside
// its own AVX-512 intrinsics (the `__Y = __Y` idiom of _mm256_undefined_pd) once Eigen's GEMM
// is inlined into a weave function. The diagnostic state GCC consults is the one in force where
// the intrinsic headers were read, so silencing it around this include keeps the false
// positive out of -Werror while weave's own code stays fully warned.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <Eigen/Core>
#pragma GCC diagnostic pop

namespace weave::kernels::cpu {
/// A dynamic row-major matrix, the layout of weave's contiguous tensors.
template <class T>
using RowMajor = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
}  // namespace weave::kernels::cpu
