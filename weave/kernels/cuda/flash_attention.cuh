#pragma once
// The pieces flash_attention.cu (forward) and flash_attention_backward.cu share: the problem's
// description, tile loads, the two warp-level products, the online softmax, the document spans
// of packed sequences and the host-side launch helpers.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <initializer_list>
#include <mutex>

#include "weave/kernels/backends.h"
#include "weave/kernels/cuda/mma.cuh"
#include "weave/tensor/cuda/common.cuh"

namespace weave::kernels::cuda::flash {

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

/// A tile's smallest and largest document.
struct Span {
  int64_t lo, hi;
};

/// Packed sequences: query i sees key j only where their documents are equal. Each 64-row
/// tile's span of documents lets a query tile skip the key tiles it shares no document with,
/// and skip the per-element test where both tiles lie inside one document (most pairs).
struct Documents {
  const int64_t* query = nullptr;     // [B, Tq]; null: not packed
  const int64_t* key = nullptr;       // [B, Tk]
  const Span* query_spans = nullptr;  // [B, query tiles]
  const Span* key_spans = nullptr;    // [B, key tiles]
  int64_t query_tiles = 0, key_tiles = 0;
};

struct FlashParams {
  Operand q, k, v, out, grad, dq, dk, dv;
  float* lse;    // [B, H, Tq], natural log
  float* delta;  // [B, H, Tq]: rowsum(dO o O)
  int64_t heads, tq, tk;
  int64_t group;  // query heads per key/value head: query head h reads key/value head h / group
  float scale, scale_log2;
  bool causal;
  Documents docs;

  /// Queries see keys [0, key_end(i)); causal masks align to the bottom right (as on CPU).
  __device__ int64_t key_end(int64_t i) const {
    if (!causal) return tk;
    const int64_t end = i + 1 + tk - tq;
    return end < 0 ? 0 : (end > tk ? tk : end);
  }
  __device__ bool packed() const { return docs.query != nullptr; }
  __device__ Span query_span(int64_t b, int64_t first_row) const {
    return docs.query_spans[b * docs.query_tiles + first_row / kBlock];
  }
  __device__ Span key_span(int64_t b, int64_t first_key) const {
    return docs.key_spans[b * docs.key_tiles + first_key / kBlock];
  }
  /// Document of query row i (-1 past the queries: those rows are never stored).
  __device__ int64_t query_document(int64_t b, int64_t i) const {
    return packed() && i < tq ? docs.query[b * tq + i] : -1;
  }
  __device__ int64_t key_document(int64_t b, int64_t j) const {
    return packed() && j < tk ? docs.key[b * tk + j] : -2;
  }
};

__device__ inline bool overlap(Span a, Span b) {
  return a.lo <= b.hi && b.lo <= a.hi;
}
/// Both tiles inside one and the same document: no element of the pair needs the test.
__device__ inline bool one_document(Span a, Span b) {
  return a.lo == a.hi && b.lo == b.hi && a.lo == b.lo;
}

/// Rows [begin, end) of the tiles of `count` rows from 0 whose spans share a document with
/// `with`: their hull (exact for packed windows, whose documents never come back; any other
/// tile inside the hull is masked element by element). Everything when not packed.
__device__ inline void document_hull(const Span* spans, int64_t count, Span with, int64_t& begin,
                                     int64_t& end) {
  const int64_t tiles = (count + kBlock - 1) / kBlock;
  int64_t first = tiles, last = -1;
  for (int64_t i = 0; i < tiles; ++i) {
    if (!overlap(spans[i], with)) continue;
    first = first < i ? first : i;
    last = i;
  }
  begin = last < 0 ? 0 : first * kBlock;
  end = last < 0 ? 0 : ((last + 1) * kBlock < count ? (last + 1) * kBlock : count);
}

/// What a (query tile, key tile) pair needs to hide keys of other documents: null `keys` when
/// nothing (not packed, or one document), else this batch's key documents and the two rows'.
struct TileDocuments {
  const int64_t* keys = nullptr;
  int64_t rows[2] = {0, 0};
  __device__ bool sees(int r, int64_t key) const { return keys == nullptr || keys[key] == rows[r]; }
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
                               int64_t n0, const int64_t* ends, const TileDocuments& docs, int t,
                               float scale_log2) {
  // Tiles that both rows see whole (most of them) skip the per-element mask.
  const bool whole = n0 + kBlock <= ends[0] && n0 + kBlock <= ends[1] && docs.keys == nullptr;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        float& x = s[nt][2 * r + c];
        const int64_t key = n0 + nt * 8 + 2 * t + c;
        x = whole || (key < ends[r] && docs.sees(r, key)) ? x * scale_log2 : -INFINITY;
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

/// The keys a query block [m0, m0 + kBlock) reaches, [begin, end), and its span of documents.
__device__ inline void query_block_keys(const FlashParams& p, int64_t b, int64_t m0, int64_t& begin,
                                        int64_t& end, Span& span) {
  const int64_t last_row = (m0 + kBlock < p.tq ? m0 + kBlock : p.tq) - 1;
  begin = 0;
  end = p.key_end(last_row);
  if (!p.packed()) return;
  span = p.query_span(b, m0);
  int64_t hull_begin, hull_end;
  document_hull(p.docs.key_spans + b * p.docs.key_tiles, p.tk, span, hull_begin, hull_end);
  begin = hull_begin;
  end = end < hull_end ? end : hull_end;
}

/// The document test a query block with `span` needs against the key tile at n0.
__device__ inline TileDocuments tile_documents(const FlashParams& p, int64_t b, Span span,
                                               int64_t n0, const int64_t* rows) {
  TileDocuments docs;
  if (!p.packed() || one_document(span, p.key_span(b, n0))) return docs;
  docs.keys = p.docs.key + b * p.tk;
  docs.rows[0] = p.query_document(b, rows[0]);
  docs.rows[1] = p.query_document(b, rows[1]);
  return docs;
}

// Host side.

/// The operands, sizes and (packed sequences) document spans of one call; the spans live in
/// `spans`, which the caller keeps until the kernels are queued.
FlashParams params_of(const Tensor& q, const Tensor& k, const Tensor& v,
                      const AttentionParams& params, Tensor& spans);
Operand operand_of(const Tensor& t);
dim3 flash_grid(int64_t rows, int64_t batch_heads);
void check_aligned(std::initializer_list<const Tensor*> tensors);

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

}  // namespace weave::kernels::cuda::flash
