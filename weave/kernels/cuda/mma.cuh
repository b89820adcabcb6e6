#pragma once
// Warp-level tensor-core building blocks (sm_80 and newer): mma.sync m16n8k16 with float
// accumulators, ldmatrix fragment loads from shared memory, and cp.async copies into it.
//
// Fragment layouts of m16n8k16 (g = lane / 4, t = lane % 4):
//   A (16 x 16, 4 registers of 2 halves): rows g and g + 8, columns 2t, 2t + 1 (+ 8);
//   B (16 x 8, 2 registers): rows (k) 2t, 2t + 1 (+ 8), column (n) g;
//   C (16 x 8, 4 floats): c0, c1 at row g, columns 2t, 2t + 1; c2, c3 at row g + 8.
// Two adjacent C tiles of a 16 x 16 product are therefore one A operand once packed, which is
// how attention feeds its probabilities to the next product without shared memory.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace weave::kernels::cuda::mma {

template <class T>
__device__ inline uint32_t pack(float lo, float hi) {
  uint32_t bits;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    memcpy(&bits, &v, sizeof bits);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    memcpy(&bits, &v, sizeof bits);
  }
  return bits;
}

/// c += a b for one 16 x 8 tile.
template <class T>
__device__ inline void mma_16x8x16(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#else
  (void)c, (void)a, (void)b0, (void)b1;
  __trap();
#endif
}

__device__ inline uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

/// Four 8 x 8 matrices (each transposed with `transpose`); lane l gives the address of row
/// l % 8 of matrix l / 8.
template <bool transpose = false>
__device__ inline void ldmatrix_x4(uint32_t* r, const void* row_address) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (transpose)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row_address)));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row_address)));
#else
  (void)r, (void)row_address;
  __trap();
#endif
}

/// 16 bytes from global to shared memory without passing through registers; zeros when
/// !valid (src is then never read).
__device__ inline void copy_async_16(void* dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)),
               "l"(src), "r"(valid ? 16 : 0));
#else
  (void)dst, (void)src, (void)valid;
  __trap();
#endif
}

__device__ inline void copy_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

/// Waits until at most `pending` committed groups are still in flight.
template <int pending>
__device__ inline void copy_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(pending));
#endif
}

}  // namespace weave::kernels::cuda::mma
