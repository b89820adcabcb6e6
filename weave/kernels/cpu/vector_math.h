#pragma once
// glibc's vector math library (libmvec): declaring the math functions as SIMD-enabled lets GCC
// vectorize the elementwise loops that call them (exp, log, tanh, ... 8 floats per call with
// AVX2, SSE variants for baseline x86-64) instead of calling the scalar function per element.
// glibc declares these itself only under -ffast-math; libmvec's results are within 4 ulp.
// CMake defines WEAVE_WITH_LIBMVEC when it links libmvec (x86-64 glibc).
#include <cmath>
#include <cstdint>

#if defined(WEAVE_WITH_LIBMVEC) && defined(__x86_64__) && defined(__GLIBC__) && \
    !defined(__FAST_MATH__)
#define WEAVE_SIMD_MATH __attribute__((__simd__("notinbranch")))
extern "C" {
WEAVE_SIMD_MATH float expf(float) noexcept;
WEAVE_SIMD_MATH double exp(double) noexcept;
WEAVE_SIMD_MATH float logf(float) noexcept;
WEAVE_SIMD_MATH double log(double) noexcept;
WEAVE_SIMD_MATH float sinf(float) noexcept;
WEAVE_SIMD_MATH double sin(double) noexcept;
WEAVE_SIMD_MATH float cosf(float) noexcept;
WEAVE_SIMD_MATH double cos(double) noexcept;
WEAVE_SIMD_MATH float tanhf(float) noexcept;
WEAVE_SIMD_MATH double tanh(double) noexcept;
WEAVE_SIMD_MATH float erff(float) noexcept;
WEAVE_SIMD_MATH double erf(double) noexcept;
WEAVE_SIMD_MATH float powf(float, float) noexcept;
WEAVE_SIMD_MATH double pow(double, double) noexcept;
}
#undef WEAVE_SIMD_MATH
#endif

namespace weave::kernels::cpu {

// Reductions over a contiguous row. `omp simd reduction` lets the compiler reorder the sum and
// the maximum across vector lanes, which it may not do on its own without -ffast-math; each
// row is short, so the reordering changes float32 results only in the last bits.

/// The largest element, NaN if any is NaN, -inf for an empty row.
template <class T>
inline T row_max(const T* x, int64_t n) {
  T m = -INFINITY;
  bool nan = false;
#pragma omp simd reduction(max : m) reduction(|| : nan)
  for (int64_t j = 0; j < n; ++j) {
    m = x[j] > m ? x[j] : m;
    nan = nan || x[j] != x[j];
  }
  return nan ? T(NAN) : m;
}

/// The shift that keeps exp in range: a row's maximum, or 0 when that is infinite (a row of
/// -inf, everything masked, then gives exp(-inf) = 0 everywhere instead of NaN).
template <class T>
inline T safe_shift(T m) {
  return std::isinf(m) ? T(0) : m;
}

/// Writes exp(x - shift) over x in place and returns the sum.
template <class T>
inline T exp_shifted_in_place(T* x, int64_t n, T shift) {
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    x[j] = std::exp(x[j] - shift);
    sum += x[j];
  }
  return sum;
}

/// sum_j f(j) for a vectorizable f.
template <class T, class F>
inline T row_sum(int64_t n, const F& f) {
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) sum += f(j);
  return sum;
}

}  // namespace weave::kernels::cpu
