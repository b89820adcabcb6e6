#pragma once
// glibc's vector math library (libmvec): declaring the math functions as SIMD-enabled lets GCC
// vectorize the elementwise loops that call them (exp, log, tanh, ... 8 floats per call with
// AVX2, SSE variants for baseline x86-64) instead of calling the scalar function per element.
// glibc declares these itself only under -ffast-math; libmvec's results are within 4 ulp.
// CMake defines WEAVE_WITH_LIBMVEC when it links libmvec (x86-64 glibc).
#include <cmath>

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
