// Attention on tensor cores for bfloat16 and float16 (sm_80 and newer), the FlashAttention-2
// algorithm: a block of 64 queries keeps its output in registers while 64-key tiles of K and V
// stream through shared memory (cp.async, the next K tile in flight during the product with V);
// the online softmax runs on the accumulator fragments, which feed the next product directly.
// Only each row's log-sum-exp is kept. Under a causal mask the query blocks that see the most
// keys are started first. Packed sequences (document ids) visit only the key tiles that share a
// document with the query block, and test documents element by element only in the tiles
// where a document starts or ends. The backward is in flash_attention_backward.cu.
#include "weave/kernels/cuda/flash_attention.cuh"

namespace weave::kernels::cuda {

using namespace flash;

namespace {

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
  int64_t first_key, keys;
  Span span{};
  query_block_keys(p, b, m0, first_key, keys, span);
  load_tile<D>(q_tile, q, p.q.row, m0, p.tq);
  load_tile<D>(k_tile, k, p.k.row, first_key, p.tk);
  mma::copy_async_commit();
  float o[D / 8][4] = {};
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  const int64_t rows[2] = {m0 + warp * 16 + lane / 4, m0 + warp * 16 + lane / 4 + 8};
  const int64_t ends[2] = {p.key_end(rows[0]), p.key_end(rows[1])};
  for (int64_t n0 = first_key; n0 < keys; n0 += kBlock) {
    load_tile<D>(v_tile, v, p.v.row, n0, p.tk);
    mma::copy_async_commit();
    mma::copy_async_wait<1>();  // Q and this K tile
    __syncthreads();
    float s[8][4] = {};
    rows_times_rows<D>(s, q_tile, warp * 16, k_tile, lane);
    online_softmax<D>(s, o, m_run, l_run, n0, ends, tile_documents(p, b, span, n0, rows), t,
                      p.scale_log2);
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

// Each 64-row tile's smallest and largest document, a thread per tile.
__global__ void document_spans_kernel(const int64_t* documents, int64_t batch, int64_t length,
                                      Span* spans) {
  const int64_t tiles = (length + kBlock - 1) / kBlock;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= batch * tiles) return;
  const int64_t b = i / tiles, first = (i % tiles) * kBlock;
  const int64_t end = first + kBlock < length ? first + kBlock : length;
  const int64_t* row = documents + b * length;
  Span span{row[first], row[first]};
  for (int64_t j = first + 1; j < end; ++j) {
    span.lo = row[j] < span.lo ? row[j] : span.lo;
    span.hi = row[j] > span.hi ? row[j] : span.hi;
  }
  spans[i] = span;
}

}  // namespace

namespace flash {

Operand operand_of(const Tensor& t) {
  if (!t.defined()) return {};
  return {const_cast<void*>(t.data_ptr()), t.strides()[0], t.strides()[1], t.strides()[2]};
}

FlashParams params_of(const Tensor& q, const Tensor& k, const Tensor& v,
                      const AttentionParams& params, Tensor& spans) {
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
  if (!params.query_documents.defined()) return p;
  const int64_t batch = q.size(0);
  Documents& d = p.docs;
  d.query_tiles = (p.tq + kBlock - 1) / kBlock;
  d.key_tiles = (p.tk + kBlock - 1) / kBlock;
  static_assert(sizeof(Span) == 2 * sizeof(int64_t));
  spans =
      empty({batch * (d.query_tiles + d.key_tiles), 2}, {.dtype = kInt64, .device = q.device()});
  Span* all = static_cast<Span*>(spans.data_ptr());
  d.query = params.query_documents.data<int64_t>();
  d.key = params.key_documents.data<int64_t>();
  d.query_spans = all;
  d.key_spans = all + batch * d.query_tiles;
  cudaStream_t s = weave::cuda::stream(q.device().index);
  auto spans_of = [&](const int64_t* ids, int64_t length, Span* out) {
    const int64_t n = batch * ((length + kBlock - 1) / kBlock);
    if (n == 0) return;
    document_spans_kernel<<<blocks_for(n, kThreads), kThreads, 0, s>>>(ids, batch, length, out);
    check_launch("scaled_dot_product_attention");
  };
  spans_of(d.query, p.tq, all);
  spans_of(d.key, p.tk, all + batch * d.query_tiles);
  return p;
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

}  // namespace flash

bool attention_on_tensor_cores(const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& mask, const AttentionParams& params) {
  if (!q.device().is_cuda() || (q.dtype() != kBFloat16 && q.dtype() != kFloat16)) return false;
  if (mask.defined() || params.dropout_p > 0) return false;
  // Windows, soft-caps and ring attention's offset blocks take the float32 kernels (the tiles
  // here mask only bottom-right causal rows and documents).
  if (params.window > 0 || params.softcap > 0 || params.query_start) return false;
  // Grouped-query attention: query head h reads key/value head h / (H / H_kv) in place.
  if (k.size(1) == 0 || q.size(1) % k.size(1) != 0 || v.size(1) != k.size(1)) return false;
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
  Tensor spans;
  FlashParams p = params_of(q, k, v, params, spans);
  p.out = operand_of(out);
  p.lse = static_cast<float*>(lse.data_ptr());
  with_flash_types(q, [&](auto tag, auto size) {
    using T = decltype(tag);
    constexpr int D = decltype(size)::value;
    launch_flash<flash_forward_kernel<T, D>>(flash_grid(p.tq, q.size(0) * p.heads),
                                             3 * kBlock * D * sizeof(T), s, p);
  });
}

}  // namespace weave::kernels::cuda
