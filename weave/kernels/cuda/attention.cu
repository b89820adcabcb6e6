// Fused attention on CUDA in the style of FlashAttention-2: a thread per query row (forward,
// dq) or key row (dk, dv) keeps its row and accumulators in registers while tiles of the other
// side stream through shared memory; the forward's online softmax keeps only each row's
// log-sum-exp, and the backward recomputes the probabilities from it. CUDA cores, no tensor
// cores: bfloat16 and float16 run on them in flash_attention.cu; these kernels serve float32,
// float64, masks and dropout.
#include <cuda_runtime.h>

#include <cmath>

#include "weave/kernels/backends.h"
#include "weave/tensor/cuda/common.cuh"

namespace weave::kernels::cuda {

namespace {

constexpr int kRowsPerBlock = 64, kTile = 32;

struct Layout {  // element strides of a [B, H, T, D] operand
  int64_t batch, head, row;
};

Layout layout_of(const Tensor& t) {
  return {t.strides()[0], t.strides()[1], t.strides()[2]};
}

template <class T>
struct Problem {
  const T *q, *k, *v, *out, *grad, *lse;
  Layout lq, lk, lv, lo, lg;
  int64_t heads, group, tq, tk, d, dv;  // query head h reads key/value head h / group
  T scale, cap;                         // cap: the soft-cap (0: none)
  functors::KeyRange range;
  const bool* allowed;
  const T* additive;
  const int64_t *query_doc, *key_doc;  // packed sequences: [B, Tq], [B, Tk] (or null)
  int64_t ms[4];
  double dropout_p;
  uint64_t seed;

  /// The scaled score s soft-capped and masked, or -inf where the query may not see the key.
  __device__ T masked(T s, int64_t b, int64_t h, int64_t i, int64_t j) const {
    if (!range.sees(i, j)) return -INFINITY;
    s = functors::softcap(s, cap);
    if (query_doc && query_doc[b * tq + i] != key_doc[b * tk + j]) return -INFINITY;
    const int64_t at = b * ms[0] + h * ms[1] + i * ms[2] + j * ms[3];
    if (allowed && !allowed[at]) return -INFINITY;
    if (additive) s += additive[at];
    return s;
  }
  /// d(capped score) / d(raw scaled score).
  __device__ T through_cap(T raw) const {
    return functors::softcap_grad(functors::softcap(raw, cap), cap);
  }
  __device__ T keep(int64_t b, int64_t h, int64_t i, int64_t j) const {
    if (dropout_p == 0) return T(1);
    const uint64_t index = uint64_t(((b * heads + h) * tq + i) * tk + j);
    return functors::dropout_keep(seed, index, dropout_p) ? T(1.0 / (1.0 - dropout_p)) : T(0);
  }
};

template <class T>
__device__ T dot(const T* a, const T* b, int64_t n) {
  T sum = 0;
  for (int64_t c = 0; c < n; ++c) sum += a[c] * b[c];
  return sum;
}

/// Copies rows [j0, j0 + count) of a [B, H, T, D] operand into a shared tile [kTile, D].
template <class T>
__device__ void load_tile(T* tile, const T* base, Layout l, int64_t b, int64_t h, int64_t j0,
                          int64_t count, int64_t d) {
  for (int64_t e = threadIdx.x; e < count * d; e += blockDim.x) {
    const int64_t r = e / d, c = e % d;
    tile[r * d + c] = base[b * l.batch + h * l.head + (j0 + r) * l.row + c];
  }
}

/// Row i of a [B, H, T, D] operand times factor into registers (zeros for an inactive thread).
template <class T>
__device__ void load_row(T* dst, const T* base, Layout l, int64_t b, int64_t h, int64_t i,
                         int64_t n, T factor, bool active) {
  for (int64_t c = 0; c < n; ++c)
    dst[c] = active ? base[b * l.batch + h * l.head + i * l.row + c] * factor : T(0);
}

/// Streams rows [first, end) of two [B, H, T, *] operands (keys and values, or queries and
/// output gradients) through shared memory a tile at a time, calling body(tile_a, tile_b, row0,
/// count) on the threads whose own row is active. Every thread of the block must call it: it
/// synchronizes.
template <class T, class Body>
__device__ void for_each_tile(const T* a, Layout la, int64_t width_a, const T* b_op, Layout lb,
                              int64_t width_b, int64_t b, int64_t h, int64_t first, int64_t end,
                              bool active, const Body& body) {
  extern __shared__ unsigned char shared_bytes[];
  T* tile_a = reinterpret_cast<T*>(shared_bytes);
  T* tile_b = tile_a + kTile * width_a;
  for (int64_t r0 = first; r0 < end; r0 += kTile) {
    const int64_t count = min(int64_t(kTile), end - r0);
    __syncthreads();
    load_tile(tile_a, a, la, b, h, r0, count, width_a);
    load_tile(tile_b, b_op, lb, b, h, r0, count, width_b);
    __syncthreads();
    if (active) body(tile_a, tile_b, r0, count);
  }
}

template <class T, int kMaxD>
__global__ void forward_kernel(Problem<T> p, T* out, Layout lo, T* lse) {
  const int64_t bh = blockIdx.y, b = bh / p.heads, h = bh % p.heads;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool active = i < p.tq;
  T qr[kMaxD], acc[kMaxD];
  load_row(qr, p.q, p.lq, b, h, i, p.d, p.scale, active);
  for (int64_t c = 0; c < p.dv; ++c) acc[c] = 0;
  T m = -INFINITY, l = 0;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x;
  const int64_t last = min(first + blockDim.x, p.tq) - 1;
  auto body = [&](const T* ks, const T* vs, int64_t j0, int64_t count) {
    for (int64_t c = 0; c < count; ++c) {
      const T s = p.masked(dot(qr, ks + c * p.d, p.d), b, h, i, j0 + c);
      if (s == -INFINITY) continue;
      if (s > m) {  // a new maximum rescales what was summed so far
        const T correction = exp(m - s);
        l *= correction;
        for (int64_t e = 0; e < p.dv; ++e) acc[e] *= correction;
        m = s;
      }
      const T weight = exp(s - m);
      l += weight;
      const T dropped = weight * p.keep(b, h, i, j0 + c);
      for (int64_t e = 0; e < p.dv; ++e) acc[e] += dropped * vs[c * p.dv + e];
    }
  };
  for_each_tile(p.k, p.lk, p.d, p.v, p.lv, p.dv, b, h / p.group, p.range.begin(first),
                p.range.end(last), active, body);
  if (!active) return;
  T* o = out + b * lo.batch + h * lo.head + i * lo.row;
  for (int64_t e = 0; e < p.dv; ++e) o[e] = l > 0 ? acc[e] / l : T(0);
  lse[bh * p.tq + i] = l > 0 ? m + log(l) : T(INFINITY);
}

// delta_i = sum_e dO_ie O_ie
template <class T>
__global__ void delta_kernel(Problem<T> p, T* delta, int64_t rows) {
  const int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  const int64_t bh = r / p.tq, i = r % p.tq, b = bh / p.heads, h = bh % p.heads;
  delta[r] = dot(p.grad + b * p.lg.batch + h * p.lg.head + i * p.lg.row,
                 p.out + b * p.lo.batch + h * p.lo.head + i * p.lo.row, p.dv);
}

// A thread per query row: dq_i = scale sum_j dS_ij k_j (and dS into dmask when asked).
template <class T, int kMaxD>
__global__ void dq_kernel(Problem<T> p, const T* delta, T* dq, Layout ldq, T* dmask) {
  const int64_t bh = blockIdx.y, b = bh / p.heads, h = bh % p.heads;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool active = i < p.tq;
  T qr[kMaxD], gr[kMaxD], acc[kMaxD];
  load_row(qr, p.q, p.lq, b, h, i, p.d, p.scale, active);
  load_row(gr, p.grad, p.lg, b, h, i, p.dv, T(1), active);
  for (int64_t c = 0; c < p.d; ++c) acc[c] = 0;
  const T row_lse = active ? p.lse[bh * p.tq + i] : T(0);
  const T row_delta = active ? delta[bh * p.tq + i] : T(0);
  const int64_t first = int64_t(blockIdx.x) * blockDim.x;
  const int64_t last = min(first + blockDim.x, p.tq) - 1;
  auto body = [&](const T* ks, const T* vs, int64_t j0, int64_t count) {
    for (int64_t c = 0; c < count; ++c) {
      const int64_t j = j0 + c;
      const T raw = dot(qr, ks + c * p.d, p.d), s = p.masked(raw, b, h, i, j);
      const T prob = s == -INFINITY ? T(0) : exp(s - row_lse);
      const T ds = prob * (dot(gr, vs + c * p.dv, p.dv) * p.keep(b, h, i, j) - row_delta);
      if (dmask) dmask[(bh * p.tq + i) * p.tk + j] = ds;
      const T raw_ds = prob == T(0) ? T(0) : ds * p.through_cap(raw);
      for (int64_t e = 0; e < p.d; ++e) acc[e] += raw_ds * ks[c * p.d + e];
    }
  };
  for_each_tile(p.k, p.lk, p.d, p.v, p.lv, p.dv, b, h / p.group, p.range.begin(first),
                p.range.end(last), active, body);
  if (!active) return;
  T* o = dq + b * ldq.batch + h * ldq.head + i * ldq.row;
  for (int64_t e = 0; e < p.d; ++e) o[e] = acc[e] * p.scale;
}

// A thread per key row of a key/value head: dv_j = sum_i P_ij keep_ij dO_i and
// dk_j = scale sum_i dS_ij q_i, the sums over every query head of its group in turn.
template <class T, int kMaxD>
__global__ void dkv_kernel(Problem<T> p, const T* delta, T* dk, Layout ldk, T* dv, Layout ldv) {
  const int64_t kv_heads = p.heads / p.group;
  const int64_t bkv = blockIdx.y, b = bkv / kv_heads, kv = bkv % kv_heads;
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool active = j < p.tk;
  T kr[kMaxD], vr[kMaxD], dk_acc[kMaxD], dv_acc[kMaxD];
  load_row(kr, p.k, p.lk, b, kv, j, p.d, T(1), active);
  load_row(vr, p.v, p.lv, b, kv, j, p.dv, T(1), active);
  for (int64_t c = 0; c < p.d; ++c) dk_acc[c] = 0;
  for (int64_t c = 0; c < p.dv; ++c) dv_acc[c] = 0;
  // Queries before the block's first key's first viewer see none of its keys.
  const int64_t first_key = int64_t(blockIdx.x) * blockDim.x;
  const int64_t last_key = min(first_key + blockDim.x, p.tk) - 1;
  const int64_t first = p.range.first_query(first_key), end = p.range.query_end(last_key);
  int64_t h = kv * p.group;  // the query head being summed
  auto body = [&](const T* qs, const T* gs, int64_t i0, int64_t count) {
    const int64_t row0 = (b * p.heads + h) * p.tq;
    for (int64_t r = 0; r < count; ++r) {
      const int64_t i = i0 + r;
      const T raw = dot(kr, qs + r * p.d, p.d) * p.scale, s = p.masked(raw, b, h, i, j);
      if (s == -INFINITY) continue;
      const T prob = exp(s - p.lse[row0 + i]), keep = p.keep(b, h, i, j);
      const T* g = gs + r * p.dv;
      for (int64_t e = 0; e < p.dv; ++e) dv_acc[e] += prob * keep * g[e];
      const T ds = prob * (dot(g, vr, p.dv) * keep - delta[row0 + i]) * p.through_cap(raw);
      for (int64_t e = 0; e < p.d; ++e) dk_acc[e] += ds * qs[r * p.d + e];
    }
  };
  for (; h < (kv + 1) * p.group; ++h)
    for_each_tile(p.q, p.lq, p.d, p.grad, p.lg, p.dv, b, h, first, end, active, body);
  if (!active) return;
  T* ok = dk + b * ldk.batch + kv * ldk.head + j * ldk.row;
  T* ov = dv + b * ldv.batch + kv * ldv.head + j * ldv.row;
  for (int64_t e = 0; e < p.d; ++e) ok[e] = dk_acc[e] * p.scale;
  for (int64_t e = 0; e < p.dv; ++e) ov[e] = dv_acc[e];
}

template <class T>
Problem<T> problem_of(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                      const AttentionParams& params) {
  Problem<T> p{};
  p.q = static_cast<const T*>(q.data_ptr());
  p.k = static_cast<const T*>(k.data_ptr());
  p.v = static_cast<const T*>(v.data_ptr());
  p.lq = layout_of(q);
  p.lk = layout_of(k);
  p.lv = layout_of(v);
  p.heads = q.size(1);
  p.group = q.size(1) / k.size(1);
  p.tq = q.size(2);
  p.tk = k.size(2);
  p.d = q.size(3);
  p.dv = v.size(3);
  p.scale = T(params.scale);
  p.cap = T(params.softcap);
  p.range = key_range(params, p.tq, p.tk);
  if (mask.defined()) {
    if (mask.dtype() == kBool)
      p.allowed = static_cast<const bool*>(mask.data_ptr());
    else
      p.additive = static_cast<const T*>(mask.data_ptr());
    for (int d = 0; d < 4; ++d) p.ms[d] = mask.strides()[d];
  }
  p.dropout_p = params.dropout_p;
  p.seed = params.dropout_seed;
  if (params.query_documents.defined()) {
    p.query_doc = params.query_documents.data<int64_t>();
    p.key_doc = params.key_documents.data<int64_t>();
  }
  return p;
}

/// Calls launch(std::integral_constant<int, kMaxD>) with the smallest register row that fits.
template <class Launch>
void with_head_size(int64_t d, const Launch& launch) {
  if (d <= 64) return launch(std::integral_constant<int, 64>{});
  if (d <= 128) return launch(std::integral_constant<int, 128>{});
  if (d <= 256) return launch(std::integral_constant<int, 256>{});
  WEAVE_FAIL("scaled_dot_product_attention", "head sizes up to 256 are supported on CUDA, found {}",
             d);
}

dim3 grid_for(int64_t rows, int64_t batch_heads) {
  WEAVE_CHECK(batch_heads <= 65535, "scaled_dot_product_attention",
              "batch x heads = {} exceeds one launch's 65535", batch_heads);
  return dim3(blocks_for(rows, kRowsPerBlock), unsigned(batch_heads));
}

}  // namespace

void attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
               const AttentionParams& params, const Tensor& out, const Tensor& lse) {
  if (is_reduced_float(q.dtype())) {
    WEAVE_CHECK(attention_on_tensor_cores(q, k, v, mask, params), "scaled_dot_product_attention",
                "bfloat16/float16 attention runs on tensor cores only (no mask or dropout, head "
                "size 64 or 128, sm_80+); hint: the op computes other cases in float32");
    if (!cudnn_attention(q, k, v, params, out, lse)) flash_attention(q, k, v, params, out, lse);
    return;
  }
  DeviceGuard guard(q.device().index);
  cudaStream_t s = weave::cuda::stream(q.device().index);
  visit_floating(q.dtype(), "scaled_dot_product_attention", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const Problem<T> p = problem_of<T>(q, k, v, mask, params);
    const size_t shared = kTile * (p.d + p.dv) * sizeof(T);
    with_head_size(std::max(p.d, p.dv), [&](auto max_d) {
      forward_kernel<T, decltype(max_d)::value>
          <<<grid_for(p.tq, q.size(0) * p.heads), kRowsPerBlock, shared, s>>>(
              p, static_cast<T*>(out.data_ptr()), layout_of(out), static_cast<T*>(lse.data_ptr()));
    });
  });
  check_launch("scaled_dot_product_attention");
}

void attention_backward(const Tensor& grad, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& mask, const AttentionParams& params, const Tensor& out,
                        const Tensor& lse, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                        const Tensor& dmask) {
  if (is_reduced_float(q.dtype())) {
    if (!cudnn_attention_backward(grad, q, k, v, params, out, lse, dq, dk, dv))
      flash_attention_backward(grad, q, k, v, params, out, lse, dq, dk, dv);
    return;
  }
  DeviceGuard guard(q.device().index);
  cudaStream_t s = weave::cuda::stream(q.device().index);
  Tensor delta = empty(lse.shape(), {.dtype = lse.dtype(), .device = lse.device()});
  visit_floating(q.dtype(), "scaled_dot_product_attention", [&](auto tag) {
    using T = typename decltype(tag)::type;
    Problem<T> p = problem_of<T>(q, k, v, mask, params);
    p.out = static_cast<const T*>(out.data_ptr());
    p.grad = static_cast<const T*>(grad.data_ptr());
    p.lse = static_cast<const T*>(lse.data_ptr());
    p.lo = layout_of(out);
    p.lg = layout_of(grad);
    const int64_t rows = lse.numel(), batch_heads = q.size(0) * p.heads;
    T* pdelta = static_cast<T*>(delta.data_ptr());
    delta_kernel<T><<<blocks_for(rows, kThreads), kThreads, 0, s>>>(p, pdelta, rows);
    if (dmask.defined())  // the dq kernel writes only the scores a causal block reaches
      WEAVE_CHECK_CALL(cudaMemsetAsync(dmask.data_ptr(), 0, dmask.numel() * sizeof(T), s),
                       "scaled_dot_product_attention");
    const size_t shared = kTile * (p.d + p.dv) * sizeof(T);
    with_head_size(std::max(p.d, p.dv), [&](auto max_d) {
      constexpr int kMaxD = decltype(max_d)::value;
      dq_kernel<T, kMaxD><<<grid_for(p.tq, batch_heads), kRowsPerBlock, shared, s>>>(
          p, pdelta, static_cast<T*>(dq.data_ptr()), layout_of(dq),
          dmask.defined() ? static_cast<T*>(dmask.data_ptr()) : nullptr);
      dkv_kernel<T, kMaxD><<<grid_for(p.tk, q.size(0) * k.size(1)), kRowsPerBlock, shared, s>>>(
          p, pdelta, static_cast<T*>(dk.data_ptr()), layout_of(dk), static_cast<T*>(dv.data_ptr()),
          layout_of(dv));
    });
  });
  check_launch("scaled_dot_product_attention");
}

}  // namespace weave::kernels::cuda
