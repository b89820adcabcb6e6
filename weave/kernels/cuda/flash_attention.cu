// Attention on tensor cores for bfloat16 and float16 (sm_80 and newer), the FlashAttention-2
// algorithm: a block of 64 queries keeps its output in registers while 64-key tiles of K and V
// stream through shared memory (cp.async, the next K tile in flight during the product with V);
// the online softmax runs on the accumulator fragments, which feed the next product directly.
// Only each row's log-sum-exp is kept. The backward recomputes the probabilities in two
// kernels, one per key block (dK, dV) and one per query block (dQ), each loading its next tiles
// while it computes on the current ones, so no gradient is added by atomics and every result
// is written once, in order: the same bits on every run. Under a causal mask the query blocks
// that see the most keys are started first.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <initializer_list>
#include <mutex>

#include "weave/kernels/backends.h"
#include "weave/kernels/cuda/mma.cuh"
#include "weave/tensor/cuda/common.cuh"

namespace weave::kernels::cuda {

namespace {

constexpr int kBlock = 64;  // queries and keys per tile
constexpr int kWarps = 4;   // each owns 16 rows of the block
constexpr int kBlockThreads = kWarps * 32;
constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;

struct Operand {  // a [B, H, T, D] tensor: its data and element strides
  void* data;
  int64_t batch, head, row;
  template <class T>
  __device__ T* at(int64_t b, int64_t h) const {
    return static_cast<T*>(data) + b * batch + h * head;
  }
};

struct FlashParams {
  Operand q, k, v, out, grad, dq, dk, dv;
  float* lse;    // [B, H, Tq], natural log
  float* delta;  // [B, H, Tq]: rowsum(dO o O)
  int64_t heads, tq, tk;
  int64_t group;  // query heads per key/value head: query head h reads key/value head h / group
  float scale, scale_log2;
  bool causal;

  /// Queries see keys [0, key_end(i)); causal masks align to the bottom right (as on CPU).
  __device__ int64_t key_end(int64_t i) const {
    if (!causal) return tk;
    const int64_t end = i + 1 + tk - tq;
    return end < 0 ? 0 : (end > tk ? tk : end);
  }
};

/// Element offset of 16-byte chunk `chunk` of row `row` in a [kBlock, D] tile: chunks are
/// XOR-swizzled by row so that ldmatrix's eight rows hit eight different banks.
template <int D>
__device__ inline int offset(int row, int chunk) {
  return row * D + ((chunk ^ (row & 7)) * 8);
}

/// Starts copying rows [first, first + kBlock) of an operand into a tile (zeros past `rows`).
template <int D, class T>
__device__ void load_tile(T* tile, const T* base, int64_t row_stride, int64_t first, int64_t rows) {
  constexpr int kChunks = D / 8;
  for (int e = threadIdx.x; e < kBlock * kChunks; e += blockDim.x) {
    const int r = e / kChunks, c = e % kChunks;
    const bool valid = first + r < rows;
    mma::copy_async_16(tile + offset<D>(r, c),
                       valid ? base + (first + r) * row_stride + c * 8 : base, valid);
  }
}

/// acc (16 x 64) += rows [m0, m0 + 16) of tile_a times the transpose of all 64 rows of tile_b.
template <int D, class T>
__device__ void rows_times_rows(float (&acc)[8][4], const T* tile_a, int m0, const T* tile_b,
                                int lane) {
  const int mat = lane / 8, i = lane % 8;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t a[4];
    mma::ldmatrix_x4(a, tile_a + offset<D>(m0 + i + (mat & 1) * 8, 2 * kk + (mat >> 1)));
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      uint32_t b[4];
      mma::ldmatrix_x4(b, tile_b + offset<D>(np * 16 + i + (mat >> 1) * 8, 2 * kk + (mat & 1)));
      mma::mma_16x8x16<T>(acc[2 * np], a, b[0], b[1]);
      mma::mma_16x8x16<T>(acc[2 * np + 1], a, b[2], b[3]);
    }
  }
}

/// acc (16 x D) += p (16 x 64, accumulator fragments rounded to T) times the tile (64 x D).
template <int D, class T>
__device__ void probs_times_tile(float (&acc)[D / 8][4], const float (&p)[8][4], const T* tile,
                                 int lane) {
  const int mat = lane / 8, i = lane % 8;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const uint32_t a[4] = {mma::pack<T>(p[2 * kk][0], p[2 * kk][1]),
                           mma::pack<T>(p[2 * kk][2], p[2 * kk][3]),
                           mma::pack<T>(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                           mma::pack<T>(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
    for (int np = 0; np < D / 16; ++np) {
      uint32_t b[4];
      mma::ldmatrix_x4<true>(b, tile + offset<D>(kk * 16 + i + (mat & 1) * 8, 2 * np + (mat >> 1)));
      mma::mma_16x8x16<T>(acc[2 * np], a, b[0], b[1]);
      mma::mma_16x8x16<T>(acc[2 * np + 1], a, b[2], b[3]);
    }
  }
}

__device__ inline float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ inline float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

template <class T>
__device__ inline float to_float(T x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __bfloat162float(x);
  else
    return __half2float(x);
}

/// Turns the scores s (this thread's two rows, keys from n0) into unnormalized probabilities
/// against the running maximum (log2 domain), rescaling what o and l hold for a new maximum.
template <int D>
__device__ void online_softmax(float (&s)[8][4], float (&o)[D / 8][4], float* m_run, float* l_run,
                               int64_t n0, const int64_t* ends, int t, float scale_log2) {
  // Tiles that both rows see whole (most of them) skip the per-element mask.
  const bool whole = n0 + kBlock <= ends[0] && n0 + kBlock <= ends[1];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        float& x = s[nt][2 * r + c];
        x = whole || n0 + nt * 8 + 2 * t + c < ends[r] ? x * scale_log2 : -INFINITY;
        mx = fmaxf(mx, x);
      }
    const float m_new = fmaxf(m_run[r], quad_max(mx));
    const float base = m_new == -INFINITY ? 0.f : m_new;  // a row that sees nothing yet
    const float correction = exp2f(m_run[r] - base);
    m_run[r] = m_new;
    l_run[r] *= correction;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
      o[nt][2 * r] *= correction;
      o[nt][2 * r + 1] *= correction;
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        float& x = s[nt][2 * r + c];
        x = exp2f(x - base);
        l_run[r] += x;
      }
  }
}

/// Writes a warp's 16 x D accumulator rows (rows[r] < limit) times factor[r] to an operand.
template <int D, class T>
__device__ void store_rows(const float (&acc)[D / 8][4], T* base, int64_t row_stride,
                           const int64_t* rows, int64_t limit, const float* factor, int t) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (rows[r] >= limit) continue;
    T* dst = base + rows[r] * row_stride + 2 * t;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
      const uint32_t bits =
          mma::pack<T>(acc[nt][2 * r] * factor[r], acc[nt][2 * r + 1] * factor[r]);
      *reinterpret_cast<uint32_t*>(dst + nt * 8) = bits;
    }
  }
}

/// The query block this block takes: with a causal mask the last blocks see the most keys, so
/// they start first and the short ones fill the tail of the launch.
__device__ inline int64_t heavy_first(const FlashParams& p) {
  return p.causal ? int64_t(gridDim.x) - 1 - blockIdx.x : int64_t(blockIdx.x);
}

template <class T, int D>
__global__ void __launch_bounds__(kBlockThreads) flash_forward_kernel(FlashParams p) {
  extern __shared__ __align__(128) unsigned char shared[];
  T* q_tile = reinterpret_cast<T*>(shared);
  T* k_tile = q_tile + kBlock * D;
  T* v_tile = k_tile + kBlock * D;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = lane % 4;
  const int64_t b = blockIdx.y / p.heads, h = blockIdx.y % p.heads;
  const int64_t m0 = heavy_first(p) * kBlock;
  const T *q = p.q.at<T>(b, h), *k = p.k.at<T>(b, h / p.group), *v = p.v.at<T>(b, h / p.group);
  const int64_t keys = p.key_end(min(m0 + kBlock, p.tq) - 1);
  load_tile<D>(q_tile, q, p.q.row, m0, p.tq);
  load_tile<D>(k_tile, k, p.k.row, 0, p.tk);
  mma::copy_async_commit();
  float o[D / 8][4] = {};
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  const int64_t rows[2] = {m0 + warp * 16 + lane / 4, m0 + warp * 16 + lane / 4 + 8};
  const int64_t ends[2] = {p.key_end(rows[0]), p.key_end(rows[1])};
  for (int64_t n0 = 0; n0 < keys; n0 += kBlock) {
    load_tile<D>(v_tile, v, p.v.row, n0, p.tk);
    mma::copy_async_commit();
    mma::copy_async_wait<1>();  // Q and this K tile
    __syncthreads();
    float s[8][4] = {};
    rows_times_rows<D>(s, q_tile, warp * 16, k_tile, lane);
    online_softmax<D>(s, o, m_run, l_run, n0, ends, t, p.scale_log2);
    __syncthreads();  // every warp is done with this K tile
    if (n0 + kBlock < keys) load_tile<D>(k_tile, k, p.k.row, n0 + kBlock, p.tk);
    mma::copy_async_commit();
    mma::copy_async_wait<1>();  // this V tile
    __syncthreads();
    probs_times_tile<D>(o, s, v_tile, lane);
    __syncthreads();  // every warp is done with this V tile
  }
  mma::copy_async_wait<0>();
  float inverse[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] = quad_sum(l_run[r]);
    inverse[r] = l_run[r] > 0 ? 1.f / l_run[r] : 0.f;
    if (t == 0 && rows[r] < p.tq)
      p.lse[blockIdx.y * p.tq + rows[r]] =
          l_run[r] > 0 ? (m_run[r] + log2f(l_run[r])) * kLn2 : INFINITY;
  }
  store_rows<D>(o, p.out.at<T>(b, h), p.out.row, rows, p.tq, inverse, t);
}

// delta_i = sum_e dO_ie O_ie, a warp per row.
template <class T>
__global__ void flash_delta_kernel(FlashParams p, int64_t rows, int d) {
  const int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const int64_t bh = r / p.tq, i = r % p.tq, b = bh / p.heads, h = bh % p.heads;
  const T* o = p.out.at<T>(b, h) + i * p.out.row;
  const T* g = p.grad.at<T>(b, h) + i * p.grad.row;
  float sum = 0;
  for (int c = lane; c < d; c += 32) sum += to_float(o[c]) * to_float(g[c]);
  for (int step = 16; step > 0; step /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, step);
  if (lane == 0) p.delta[r] = sum;
}

// A block of 64 queries: dQ = scale sum_j dS_ij k_j, dS = P o (dO V^T - delta). The next K and
// V tiles load while this pair is in use (two of each in shared memory).
template <class T, int D>
__global__ void __launch_bounds__(kBlockThreads) flash_dq_kernel(FlashParams p) {
  extern __shared__ __align__(128) unsigned char shared[];
  T* q_tile = reinterpret_cast<T*>(shared);
  T* g_tile = q_tile + kBlock * D;
  T* kv_tiles = g_tile + kBlock * D;  // [2][K, V]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = lane % 4;
  const int64_t b = blockIdx.y / p.heads, h = blockIdx.y % p.heads;
  const int64_t m0 = heavy_first(p) * kBlock;
  const int64_t keys = p.key_end(min(m0 + kBlock, p.tq) - 1);
  const T *k = p.k.at<T>(b, h / p.group), *v = p.v.at<T>(b, h / p.group);
  load_tile<D>(q_tile, p.q.at<T>(b, h), p.q.row, m0, p.tq);
  load_tile<D>(g_tile, p.grad.at<T>(b, h), p.grad.row, m0, p.tq);
  load_tile<D>(kv_tiles, k, p.k.row, 0, p.tk);
  load_tile<D>(kv_tiles + kBlock * D, v, p.v.row, 0, p.tk);
  mma::copy_async_commit();
  const int64_t rows[2] = {m0 + warp * 16 + lane / 4, m0 + warp * 16 + lane / 4 + 8};
  int64_t ends[2];
  float lse2[2], delta[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const bool real = rows[r] < p.tq;
    ends[r] = real ? p.key_end(rows[r]) : 0;
    lse2[r] = real ? p.lse[blockIdx.y * p.tq + rows[r]] * kLog2e : 0.f;
    delta[r] = real ? p.delta[blockIdx.y * p.tq + rows[r]] : 0.f;
  }
  float dq[D / 8][4] = {};
  for (int64_t n0 = 0, buffer = 0; n0 < keys; n0 += kBlock, buffer ^= 1) {
    if (n0 + kBlock < keys) {
      T* next = kv_tiles + (buffer ^ 1) * 2 * kBlock * D;
      load_tile<D>(next, k, p.k.row, n0 + kBlock, p.tk);
      load_tile<D>(next + kBlock * D, v, p.v.row, n0 + kBlock, p.tk);
    }
    mma::copy_async_commit();
    mma::copy_async_wait<1>();  // everything but the next pair
    __syncthreads();
    const T* k_tile = kv_tiles + buffer * 2 * kBlock * D;
    const T* v_tile = k_tile + kBlock * D;
    float s[8][4] = {}, dp[8][4] = {};
    rows_times_rows<D>(s, q_tile, warp * 16, k_tile, lane);
    rows_times_rows<D>(dp, g_tile, warp * 16, v_tile, lane);
    const bool whole = n0 + kBlock <= ends[0] && n0 + kBlock <= ends[1];  // no mask to apply
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2;
        const int64_t key = n0 + nt * 8 + 2 * t + (e & 1);
        const float prob = whole || key < ends[r] ? exp2f(s[nt][e] * p.scale_log2 - lse2[r]) : 0.f;
        s[nt][e] = prob * (dp[nt][e] - delta[r]);
      }
    probs_times_tile<D>(dq, s, k_tile, lane);
    __syncthreads();  // every warp is done with this pair before it is refilled
  }
  mma::copy_async_wait<0>();
  const float scale[2] = {p.scale, p.scale};
  store_rows<D>(dq, p.dq.at<T>(b, h), p.dq.row, rows, p.tq, scale, t);
}

// A block of 64 keys: dV = sum_i P_ij dO_i, dK = scale sum_i dS_ij q_i, over the queries that
// see them, from the transposed products S^T = K Q^T and dP^T = V dO^T. The next tiles of Q,
// dO and their rows' statistics load while these are in use (two of each in shared memory).
template <class T, int D>
__global__ void __launch_bounds__(kBlockThreads) flash_dkv_kernel(FlashParams p) {
  extern __shared__ __align__(128) unsigned char shared[];
  T* k_tile = reinterpret_cast<T*>(shared);
  T* v_tile = k_tile + kBlock * D;
  T* qg_tiles = v_tile + kBlock * D;                                   // [2][Q, dO]
  float* stats = reinterpret_cast<float*>(qg_tiles + 4 * kBlock * D);  // [2][lse2, delta]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = lane % 4;
  // One key/value head's block: the queries of every query head of its group stream past it, a
  // (head, tile) pair at a time, and dK, dV sum over all of them in registers (no atomics).
  const int64_t kv_heads = p.heads / p.group;
  const int64_t b = blockIdx.y / kv_heads, hk = blockIdx.y % kv_heads;
  const int64_t n0 = int64_t(blockIdx.x) * kBlock;  // the first key blocks see the most queries
  // The first query that sees key n0 (causal); the tiles before it see none of this block.
  int64_t first = p.causal ? n0 - (p.tk - p.tq) : 0;
  first = first < 0 ? 0 : first / kBlock * kBlock;
  const int64_t tiles = first < p.tq ? (p.tq - first + kBlock - 1) / kBlock : 0;
  const int64_t steps = tiles * p.group;
  auto tile_start = [&](int64_t step) { return first + (step % tiles) * kBlock; };
  auto load_queries = [&](int64_t step, int buffer) {
    const int64_t hq = hk * p.group + step / tiles, m0 = tile_start(step);
    T* tiles_s = qg_tiles + buffer * 2 * kBlock * D;
    load_tile<D>(tiles_s, p.q.at<T>(b, hq), p.q.row, m0, p.tq);
    load_tile<D>(tiles_s + kBlock * D, p.grad.at<T>(b, hq), p.grad.row, m0, p.tq);
    float* st = stats + buffer * 2 * kBlock;
    const int64_t row0 = (b * p.heads + hq) * p.tq + m0;
    for (int i = threadIdx.x; i < kBlock; i += blockDim.x) {
      const bool real = m0 + i < p.tq;
      st[i] = real ? p.lse[row0 + i] * kLog2e : 0.f;
      st[kBlock + i] = real ? p.delta[row0 + i] : 0.f;
    }
  };
  load_tile<D>(k_tile, p.k.at<T>(b, hk), p.k.row, n0, p.tk);
  load_tile<D>(v_tile, p.v.at<T>(b, hk), p.v.row, n0, p.tk);
  if (steps > 0) load_queries(0, 0);
  mma::copy_async_commit();
  const int64_t keys[2] = {n0 + warp * 16 + lane / 4, n0 + warp * 16 + lane / 4 + 8};
  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  int buffer = 0;
  for (int64_t step = 0; step < steps; ++step, buffer ^= 1) {
    const int64_t m0 = tile_start(step);
    if (step + 1 < steps) load_queries(step + 1, buffer ^ 1);
    mma::copy_async_commit();
    mma::copy_async_wait<1>();  // everything but the next tiles
    __syncthreads();
    const T* q_tile = qg_tiles + buffer * 2 * kBlock * D;
    const T* g_tile = q_tile + kBlock * D;
    const float* lse2_s = stats + buffer * 2 * kBlock;
    const float* delta_s = lse2_s + kBlock;
    float s[8][4] = {}, dp[8][4] = {};
    rows_times_rows<D>(s, k_tile, warp * 16, q_tile, lane);
    rows_times_rows<D>(dp, v_tile, warp * 16, g_tile, lane);
    // Every query of the tile sees every key of the block (the usual case): no mask to apply.
    const bool whole = m0 + kBlock <= p.tq && (!p.causal || p.key_end(m0) >= n0 + kBlock);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = nt * 8 + 2 * t + (e & 1);
        const int64_t query = m0 + c;
        const bool seen = whole || (query < p.tq && keys[e / 2] < p.key_end(query));
        const float prob = seen ? exp2f(s[nt][e] * p.scale_log2 - lse2_s[c]) : 0.f;
        s[nt][e] = prob;
        dp[nt][e] = prob * (dp[nt][e] - delta_s[c]);
      }
    probs_times_tile<D>(dv, s, g_tile, lane);
    probs_times_tile<D>(dk, dp, q_tile, lane);
    __syncthreads();  // every warp is done with these tiles before they are refilled
  }
  mma::copy_async_wait<0>();
  const float one[2] = {1.f, 1.f}, scale[2] = {p.scale, p.scale};
  store_rows<D>(dk, p.dk.at<T>(b, hk), p.dk.row, keys, p.tk, scale, t);
  store_rows<D>(dv, p.dv.at<T>(b, hk), p.dv.row, keys, p.tk, one, t);
}

Operand operand_of(const Tensor& t) {
  if (!t.defined()) return {};
  return {const_cast<void*>(t.data_ptr()), t.strides()[0], t.strides()[1], t.strides()[2]};
}

FlashParams params_of(const Tensor& q, const Tensor& k, const Tensor& v,
                      const AttentionParams& params) {
  FlashParams p{};
  p.q = operand_of(q);
  p.k = operand_of(k);
  p.v = operand_of(v);
  p.heads = q.size(1);
  p.group = q.size(1) / k.size(1);
  p.tq = q.size(2);
  p.tk = k.size(2);
  p.scale = float(params.scale);
  p.scale_log2 = float(params.scale) * kLog2e;
  p.causal = params.causal;
  return p;
}

/// Calls launch(T{}, std::integral_constant<int, D>{}) for q's dtype and head size.
template <class Launch>
void with_flash_types(const Tensor& q, const Launch& launch) {
  const int64_t d = q.size(3);
  auto by_size = [&](auto tag) {
    if (d == 64) return launch(tag, std::integral_constant<int, 64>{});
    if (d == 128) return launch(tag, std::integral_constant<int, 128>{});
    WEAVE_FAIL("scaled_dot_product_attention", "tensor-core head sizes are 64 and 128, found {}",
               d);
  };
  if (q.dtype() == kBFloat16) return by_size(__nv_bfloat16{});
  if (q.dtype() == kFloat16) return by_size(__half{});
  WEAVE_FAIL("scaled_dot_product_attention", "tensor-core attention takes bfloat16 or float16");
}

/// Launches kernel with `shared` bytes of dynamic shared memory, opting in past 48 KiB once per
/// kernel (each kernel always asks for the same size).
template <auto kernel>
void launch_flash(dim3 grid, size_t shared, cudaStream_t s, const FlashParams& p) {
  static std::once_flag opted_in;
  std::call_once(opted_in, [shared] {
    WEAVE_CHECK_CALL(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(shared)),
                     "scaled_dot_product_attention");
  });
  kernel<<<grid, kBlockThreads, shared, s>>>(p);
  check_launch("scaled_dot_product_attention");
}

dim3 flash_grid(int64_t rows, int64_t batch_heads) {
  WEAVE_CHECK(batch_heads <= 65535, "scaled_dot_product_attention",
              "batch x heads = {} exceeds one launch's 65535", batch_heads);
  return dim3(blocks_for(rows, kBlock), unsigned(batch_heads));
}

void check_aligned(std::initializer_list<const Tensor*> tensors) {
  for (const Tensor* t : tensors)
    WEAVE_CHECK(attention_rows_aligned(*t), "scaled_dot_product_attention",
                "tensor-core attention needs 16-byte aligned rows and strides that are multiples "
                "of 8 elements; hint: the op packs its operands, call it rather than the kernel");
}

}  // namespace

bool attention_on_tensor_cores(const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& mask, const AttentionParams& params) {
  if (!q.device().is_cuda() || (q.dtype() != kBFloat16 && q.dtype() != kFloat16)) return false;
  if (mask.defined() || params.dropout_p > 0) return false;
  // Grouped-query attention: query head h reads key/value head h / (H / H_kv) in place.
  if (k.size(1) == 0 || q.size(1) % k.size(1) != 0 || v.size(1) != k.size(1)) return false;
  if (params.query_documents.defined()) return false;  // packed sequences: the tiled kernel
  const int64_t d = q.size(3);
  if ((d != 64 && d != 128) || v.size(3) != d || k.size(3) != d) return false;
  if (q.size(0) * q.size(1) > 65535) return false;
  return weave::cuda::device_properties(q.device().index).major >= 8;
}

bool attention_rows_aligned(const Tensor& t) {
  const auto& st = t.strides();
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && st[3] == 1 && st[0] % 8 == 0 &&
         st[1] % 8 == 0 && st[2] % 8 == 0;
}

void flash_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                     const AttentionParams& params, const Tensor& out, const Tensor& lse) {
  check_aligned({&q, &k, &v, &out});
  DeviceGuard guard(q.device().index);
  cudaStream_t s = weave::cuda::stream(q.device().index);
  FlashParams p = params_of(q, k, v, params);
  p.out = operand_of(out);
  p.lse = static_cast<float*>(lse.data_ptr());
  with_flash_types(q, [&](auto tag, auto size) {
    using T = decltype(tag);
    constexpr int D = decltype(size)::value;
    launch_flash<flash_forward_kernel<T, D>>(flash_grid(p.tq, q.size(0) * p.heads),
                                             3 * kBlock * D * sizeof(T), s, p);
  });
}

void flash_attention_backward(const Tensor& grad, const Tensor& q, const Tensor& k, const Tensor& v,
                              const AttentionParams& params, const Tensor& out, const Tensor& lse,
                              const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  check_aligned({&grad, &q, &k, &v, &out, &dq, &dk, &dv});
  DeviceGuard guard(q.device().index);
  cudaStream_t s = weave::cuda::stream(q.device().index);
  Tensor delta = empty(lse.shape(), {.dtype = kFloat32, .device = lse.device()});
  FlashParams p = params_of(q, k, v, params);
  p.out = operand_of(out);
  p.grad = operand_of(grad);
  p.dq = operand_of(dq);
  p.dk = operand_of(dk);
  p.dv = operand_of(dv);
  p.lse = static_cast<float*>(lse.data_ptr());
  p.delta = static_cast<float*>(delta.data_ptr());
  const int64_t rows = lse.numel(), batch_heads = q.size(0) * p.heads;
  with_flash_types(q, [&](auto tag, auto size) {
    using T = decltype(tag);
    constexpr int D = decltype(size)::value;
    flash_delta_kernel<T><<<blocks_for(rows * 32, kThreads), kThreads, 0, s>>>(p, rows, D);
    check_launch("scaled_dot_product_attention");
    launch_flash<flash_dq_kernel<T, D>>(flash_grid(p.tq, batch_heads), 6 * kBlock * D * sizeof(T),
                                        s, p);
    launch_flash<flash_dkv_kernel<T, D>>(flash_grid(p.tk, q.size(0) * k.size(1)),
                                         6 * kBlock * D * sizeof(T) + 4 * kBlock * sizeof(float), s,
                                         p);
  });
}

}  // namespace weave::kernels::cuda
