// The backward of the tensor-core attention (flash_attention.cu): the probabilities are
// recomputed in two kernels, one per key block (dK, dV) and one per query block (dQ), each
// loading its next tiles while it computes on the current ones, so no gradient is added by
// atomics and every result is written once, in order: the same bits on every run. Packed
// sequences visit, as the forward does, only the tiles that share a document.
#include "weave/kernels/cuda/flash_attention.cuh"

namespace weave::kernels::cuda {

using namespace flash;

namespace {

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
  int64_t first_key, keys;
  Span span{};
  query_block_keys(p, b, m0, first_key, keys, span);
  const T *k = p.k.at<T>(b, h / p.group), *v = p.v.at<T>(b, h / p.group);
  load_tile<D>(q_tile, p.q.at<T>(b, h), p.q.row, m0, p.tq);
  load_tile<D>(g_tile, p.grad.at<T>(b, h), p.grad.row, m0, p.tq);
  load_tile<D>(kv_tiles, k, p.k.row, first_key, p.tk);
  load_tile<D>(kv_tiles + kBlock * D, v, p.v.row, first_key, p.tk);
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
  for (int64_t n0 = first_key, buffer = 0; n0 < keys; n0 += kBlock, buffer ^= 1) {
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
    const TileDocuments docs = tile_documents(p, b, span, n0, rows);
    // No mask to apply: both rows see the whole tile, inside their own document.
    const bool whole = n0 + kBlock <= ends[0] && n0 + kBlock <= ends[1] && docs.keys == nullptr;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2;
        const int64_t key = n0 + nt * 8 + 2 * t + (e & 1);
        const bool seen = whole || (key < ends[r] && docs.sees(r, key));
        const float prob = seen ? exp2f(s[nt][e] * p.scale_log2 - lse2[r]) : 0.f;
        s[nt][e] = prob * (dp[nt][e] - delta[r]);
      }
    probs_times_tile<D>(dq, s, k_tile, lane);
    __syncthreads();  // every warp is done with this pair before it is refilled
  }
  mma::copy_async_wait<0>();
  const float scale[2] = {p.scale, p.scale};
  store_rows<D>(dq, p.dq.at<T>(b, h), p.dq.row, rows, p.tq, scale, t);
}

/// The query tiles a key block [n0, n0 + kBlock) is seen by, [first, end) in rows, and
/// whether some pair of them needs the document test (the key block spans `span`).
struct KeyBlockQueries {
  int64_t first, end;
  Span span;
};
__device__ inline KeyBlockQueries key_block_queries(const FlashParams& p, int64_t b, int64_t n0) {
  // The first query that sees key n0 (causal); the tiles before it see none of this block.
  int64_t first = p.causal ? n0 - (p.tk - p.tq) : 0;
  first = first < 0 ? 0 : first / kBlock * kBlock;
  KeyBlockQueries r{first, p.tq, {}};
  if (!p.packed()) return r;
  r.span = p.key_span(b, n0);
  int64_t hull_first, hull_end;
  document_hull(p.docs.query_spans + b * p.docs.query_tiles, p.tq, r.span, hull_first, hull_end);
  r.first = first > hull_first ? first : hull_first;
  r.end = hull_end;
  return r;
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
  const KeyBlockQueries seen_by = key_block_queries(p, b, n0);
  const int64_t first = seen_by.first;
  const int64_t tiles = first < seen_by.end ? (seen_by.end - first + kBlock - 1) / kBlock : 0;
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
  const int64_t key_docs[2] = {p.key_document(b, keys[0]), p.key_document(b, keys[1])};
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
    const bool by_documents = p.packed() && !one_document(p.query_span(b, m0), seen_by.span);
    const bool whole =
        m0 + kBlock <= p.tq && (!p.causal || p.key_end(m0) >= n0 + kBlock) && !by_documents;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = nt * 8 + 2 * t + (e & 1);
        const int64_t query = m0 + c;
        const bool seen =
            whole || (query < p.tq && keys[e / 2] < p.key_end(query) &&
                      (!by_documents || p.query_document(b, query) == key_docs[e / 2]));
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

}  // namespace

void flash_attention_backward(const Tensor& grad, const Tensor& q, const Tensor& k, const Tensor& v,
                              const AttentionParams& params, const Tensor& out, const Tensor& lse,
                              const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  check_aligned({&grad, &q, &k, &v, &out, &dq, &dk, &dv});
  DeviceGuard guard(q.device().index);
  cudaStream_t s = weave::cuda::stream(q.device().index);
  Tensor delta = empty(lse.shape(), {.dtype = kFloat32, .device = lse.device()}), spans;
  FlashParams p = params_of(q, k, v, params, spans);
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
