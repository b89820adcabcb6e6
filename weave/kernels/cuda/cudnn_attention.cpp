// Tensor-core attention through cuDNN 9's fused flash attention (Hopper's wgmma kernels, which
// weave's mma.sync kernels in flash_attention.cu trail at long sequences). cuDNN takes attention
// as an operation graph of matmuls, pointwise operations and reductions that its runtime fuses
// into one kernel; the graphs here keep the natural-log log-sum-exp that weave's kernels keep, so
// either backward can follow either forward. A plan is built once per shape and kept, and which
// implementation runs a shape is timed once, on its first call.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>

#include "weave/kernels/backends.h"
#include "weave/kernels/cuda/cudnn_graph.h"
#include "weave/tensor/cuda/calls.h"
#include "weave/tensor/cuda/device_runtime.h"

namespace weave::kernels::cuda {

namespace {

using namespace cudnn;

// The graph's named tensors (GraphBuilder numbers intermediates from 1000).
enum Uid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kScale,
  kGradO,
  kGradQ,
  kGradK,
  kGradV,
  kRowDot,
  kGradQSum,
  kMinusInf,
  kOne
};

/// Builds one operation graph: tensors, operations, and the descriptors they hold on to.
/// Scores where the query may not see the key (causal, top-left: key > query) become -inf.
cudnnBackendDescriptor_t causal_mask(GraphBuilder& g, cudnnBackendDescriptor_t scores, Shape dims) {
  auto row = g.pointwise(CUDNN_POINTWISE_GEN_INDEX, g.intermediate(dims, CUDNN_DATA_INT32), scores,
                         nullptr, nullptr, CUDNN_DATA_INT32, 2);
  auto col = g.pointwise(CUDNN_POINTWISE_GEN_INDEX, g.intermediate(dims, CUDNN_DATA_INT32), scores,
                         nullptr, nullptr, CUDNN_DATA_INT32, 3);
  auto visible = g.pointwise(CUDNN_POINTWISE_CMP_GE, g.intermediate(dims, CUDNN_DATA_BOOLEAN), row,
                             col, nullptr, CUDNN_DATA_BOOLEAN);
  return g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, g.intermediate(dims), scores,
                     g.scalar(kMinusInf), visible);
}

/// [B, H, T, D] dimensions and strides of t; transposed: [B, H, D, T].
std::pair<Shape, Shape> layout(const Tensor& t, bool transposed = false) {
  const auto& s = t.shape();
  const auto& st = t.strides();
  if (transposed) return {{s[0], s[1], s[3], s[2]}, {st[0], st[1], st[3], st[2]}};
  return {{s[0], s[1], s[2], s[3]}, {st[0], st[1], st[2], st[3]}};
}

cudnnDataType_t cudnn_type(const Tensor& t) {
  return t.dtype() == kBFloat16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF;
}

cudnnBackendDescriptor_t operand(GraphBuilder& g, Uid uid, const Tensor& t,
                                 bool transposed = false) {
  const auto [dims, strides] = layout(t, transposed);
  return g.tensor(uid, dims, strides, cudnn_type(t));
}

cudnnBackendDescriptor_t stats(GraphBuilder& g, Uid uid, const Tensor& lse) {
  const auto& st = lse.strides();
  return g.tensor(uid, {lse.size(0), lse.size(1), lse.size(2), 1}, {st[0], st[1], st[2], 1},
                  CUDNN_DATA_FLOAT);
}

/// Attention's forward: O = softmax(scale Q K^T) V and the rows' log-sum-exp.
void forward_graph(GraphBuilder& g, const Tensor& q, const Tensor& k, const Tensor& v,
                   const Tensor& out, const Tensor& lse, bool causal) {
  const int64_t b = q.size(0), h = q.size(1), sq = q.size(2), skv = k.size(2);
  const Shape scores{b, h, sq, skv}, rows{b, h, sq, 1};
  auto s = g.matmul(g.intermediate(scores), operand(g, kQ, q), operand(g, kK, k, true));
  s = g.pointwise(CUDNN_POINTWISE_MUL, g.intermediate(scores), s, g.scalar(kScale));
  if (causal) s = causal_mask(g, s, scores);
  auto max = g.reduction(CUDNN_REDUCE_TENSOR_MAX, g.intermediate(rows), s);
  auto shifted = g.pointwise(CUDNN_POINTWISE_SUB, g.intermediate(scores), s, max);
  auto e = g.pointwise(CUDNN_POINTWISE_EXP, g.intermediate(scores), shifted);
  auto sum = g.reduction(CUDNN_REDUCE_TENSOR_ADD, g.intermediate(rows), e);
  auto log_sum = g.pointwise(CUDNN_POINTWISE_LOG, g.intermediate(rows), sum);
  g.pointwise(CUDNN_POINTWISE_ADD, stats(g, kStats, lse), max, log_sum);
  // the second product takes the probabilities in the operands' own type
  auto p = g.pointwise(CUDNN_POINTWISE_DIV, g.intermediate(scores, cudnn_type(q)), e, sum);
  g.matmul(operand(g, kO, out), p, operand(g, kV, v));
}

/// Attention's backward from the forward's log-sum-exp. With accumulate_dq, dQ is summed in a
/// float32 buffer (kGradQSum) by atomics across key blocks; without, cuDNN writes it in a fixed
/// order (its deterministic algorithm).
void backward_graph(GraphBuilder& g, const Tensor& grad, const Tensor& q, const Tensor& k,
                    const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& dq,
                    const Tensor& dk, const Tensor& dv, bool causal, bool accumulate_dq) {
  const int64_t b = q.size(0), h = q.size(1), sq = q.size(2), skv = k.size(2), d = q.size(3);
  const Shape scores{b, h, sq, skv}, rows{b, h, sq, 1}, heads{b, h, sq, d};
  const Shape transposed{b, h, skv, sq}, transposed_strides{h * sq * skv, sq * skv, 1, skv};
  const cudnnDataType_t io = cudnn_type(q);
  auto tq = operand(g, kQ, q), tkt = operand(g, kK, k, true), tvt = operand(g, kV, v, true);
  auto tgrad = operand(g, kGradO, grad), scale = g.scalar(kScale);
  // delta = rowsum(dO * O), the softmax backward's row term
  auto product = g.pointwise(CUDNN_POINTWISE_MUL, g.intermediate({b, h, sq, v.size(3)}), tgrad,
                             operand(g, kO, out));
  auto rowdot = g.reduction(CUDNN_REDUCE_TENSOR_ADD, g.intermediate(rows), product);
  auto delta =
      g.pointwise(CUDNN_POINTWISE_MUL, g.tensor(kRowDot, rows, contiguous(rows), CUDNN_DATA_FLOAT),
                  rowdot, g.scalar(kOne));
  auto s = g.matmul(g.intermediate(scores), tq, tkt);
  s = g.pointwise(CUDNN_POINTWISE_MUL, g.intermediate(scores), s, scale);
  if (causal) s = causal_mask(g, s, scores);
  s = g.pointwise(CUDNN_POINTWISE_SUB, g.intermediate(scores), s, stats(g, kStats, lse));
  auto p = g.pointwise(CUDNN_POINTWISE_EXP, g.intermediate(scores), s);
  auto pt = g.reshape(g.intermediate(transposed, transposed_strides, io), p);
  g.matmul(operand(g, kGradV, dv), pt, tgrad);
  auto dp = g.matmul(g.intermediate(scores), tgrad, tvt);
  dp = g.pointwise(CUDNN_POINTWISE_SUB, g.intermediate(scores), dp, delta);
  auto ds = g.pointwise(CUDNN_POINTWISE_MUL, g.intermediate(scores), dp, p);
  ds = g.pointwise(CUDNN_POINTWISE_MUL, g.intermediate(scores), ds, scale);
  auto dst = g.reshape(g.intermediate(transposed, transposed_strides, io), ds);
  g.matmul(operand(g, kGradK, dk), dst, tq);
  const auto [k_dims, k_strides] = layout(k);
  auto tk = g.reshape(g.intermediate(k_dims, k_strides, io), tkt);
  if (!accumulate_dq) {
    g.matmul(operand(g, kGradQ, dq), ds, tk);
    return;
  }
  auto sum = g.matmul(g.tensor(kGradQSum, heads, contiguous(heads), CUDNN_DATA_FLOAT), ds, tk);
  g.pointwise(CUDNN_POINTWISE_IDENTITY, operand(g, kGradQ, dq), sum);
}

enum class Kernel { automatic, cudnn, weave };

/// WEAVE_ATTENTION_KERNEL: auto (the faster per shape, timed once), cudnn or weave.
Kernel requested_kernel() {
  const char* value = std::getenv("WEAVE_ATTENTION_KERNEL");
  if (!value || !*value || !std::strcmp(value, "auto")) return Kernel::automatic;
  if (!std::strcmp(value, "cudnn")) return Kernel::cudnn;
  if (!std::strcmp(value, "weave")) return Kernel::weave;
  WEAVE_FAIL("scaled_dot_product_attention",
             "WEAVE_ATTENTION_KERNEL is '{}', expected auto, cudnn or weave", value);
}

/// What is known of one shape: its plan (null where cuDNN declined) and the faster kernel.
struct Entry {
  std::shared_ptr<Plan> plan;
  std::string declined;
  Kernel faster = Kernel::automatic;  // automatic: not timed yet
};

std::vector<int64_t> key_of(int64_t direction, bool causal,
                            std::initializer_list<const Tensor*> tensors) {
  std::vector<int64_t> key{direction, causal};
  for (const Tensor* t : tensors) {
    key.push_back(int64_t(t->dtype()));
    key.push_back(t->device().index);
    key.insert(key.end(), t->shape().begin(), t->shape().end());
    key.insert(key.end(), t->strides().begin(), t->strides().end());
  }
  return key;
}

template <class Build>
Entry& entry_for(const std::vector<int64_t>& key, int device, const Build& build) {
  static std::mutex mutex;
  static std::map<std::vector<int64_t>, Entry> entries;
  std::lock_guard<std::mutex> lock(mutex);
  auto [it, inserted] = entries.try_emplace(key);
  if (inserted) {
    try {
      it->second.plan = build(handle_for(device));
    } catch (const Declined& declined) {
      it->second.declined = declined.why;
      if (debugging())
        std::fprintf(stderr, "weave: cuDNN declines attention: %s\n", declined.why.c_str());
    }
  }
  return it->second;
}

/// Times both kernels on the stream (each once to warm up, then three times).
template <class CudnnRun, class WeaveRun>
Kernel time_faster(cudaStream_t stream, const CudnnRun& cudnn_run, const WeaveRun& weave_run) {
  auto time = [&](const auto& run) {
    run();
    cudaEvent_t start, stop;
    WEAVE_CHECK_CALL(cudaEventCreate(&start), "scaled_dot_product_attention");
    WEAVE_CHECK_CALL(cudaEventCreate(&stop), "scaled_dot_product_attention");
    WEAVE_CHECK_CALL(cudaEventRecord(start, stream), "scaled_dot_product_attention");
    for (int i = 0; i < 3; ++i) run();
    WEAVE_CHECK_CALL(cudaEventRecord(stop, stream), "scaled_dot_product_attention");
    WEAVE_CHECK_CALL(cudaEventSynchronize(stop), "scaled_dot_product_attention");
    float ms = 0;
    WEAVE_CHECK_CALL(cudaEventElapsedTime(&ms, start, stop), "scaled_dot_product_attention");
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    return ms;
  };
  const float cudnn_ms = time(cudnn_run), weave_ms = time(weave_run);
  if (debugging())
    std::fprintf(stderr, "weave: attention takes %.3f ms on cuDNN, %.3f ms on weave's kernels\n",
                 cudnn_ms / 3, weave_ms / 3);
  return cudnn_ms < weave_ms ? Kernel::cudnn : Kernel::weave;
}

/// Whether cuDNN runs this call: forced, or faster on its shape (timed on the first call).
template <class CudnnRun, class WeaveRun>
bool choose_cudnn(Kernel requested, Entry& entry, int device, const CudnnRun& cudnn_run,
                  const WeaveRun& weave_run) {
  if (!entry.plan) {
    WEAVE_CHECK(requested != Kernel::cudnn, "scaled_dot_product_attention",
                "WEAVE_ATTENTION_KERNEL=cudnn, but cuDNN declines this attention: {}",
                entry.declined);
    return false;
  }
  if (requested == Kernel::cudnn) return true;
  if (entry.faster == Kernel::automatic)
    entry.faster = time_faster(static_cast<cudaStream_t>(weave::cuda::stream_handle(device)),
                               cudnn_run, weave_run);
  return entry.faster == Kernel::cudnn;
}

/// cuDNN's graphs align a causal mask's diagonal top-left, weave bottom-right: they agree on
/// square score matrices only. The graphs here take a key/value head per query head (grouped
/// heads would need the backward's reduction over each group).
bool cudnn_takes(const Tensor& q, const Tensor& k, const AttentionParams& params) {
  // Packed sequences take weave's kernels, which skip the tiles no document crosses.
  return k.size(1) == q.size(1) && (!params.causal || q.size(2) == k.size(2)) &&
         !params.query_documents.defined() && params.window == 0 && params.softcap == 0 &&
         !params.query_start;
}

float minus_infinity() {
  return cudnnGetVersion() >= 91000 ? -INFINITY : std::numeric_limits<float>::lowest();
}

}  // namespace

bool cudnn_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                     const AttentionParams& params, const Tensor& out, const Tensor& lse) {
  const Kernel requested = requested_kernel();
  if (requested == Kernel::weave || !cudnn_takes(q, k, params)) return false;
  const int device = q.device().index;
  weave::cuda::DeviceGuard guard(device);
  Entry& entry = entry_for(key_of(0, params.causal, {&q, &k, &v, &out, &lse}), device,
                           [&](cudnnHandle_t handle) {
                             GraphBuilder g;
                             forward_graph(g, q, k, v, out, lse, params.causal);
                             return make_plan(g, handle);
                           });
  const float scale = float(params.scale), masked = minus_infinity();
  auto run = [&] {
    std::vector<std::pair<int64_t, const void*>> bindings{
        {kQ, q.data_ptr()},   {kK, k.data_ptr()},       {kV, v.data_ptr()},
        {kO, out.data_ptr()}, {kStats, lse.data_ptr()}, {kScale, &scale}};
    if (params.causal) bindings.push_back({kMinusInf, &masked});
    execute(*entry.plan, handle_for(device), q.device(), bindings);
  };
  if (!choose_cudnn(requested, entry, device, run,
                    [&] { flash_attention(q, k, v, params, out, lse); }))
    return false;
  run();
  return true;
}

bool cudnn_attention_backward(const Tensor& grad, const Tensor& q, const Tensor& k, const Tensor& v,
                              const AttentionParams& params, const Tensor& out, const Tensor& lse,
                              const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  const Kernel requested = requested_kernel();
  if (requested == Kernel::weave || !cudnn_takes(q, k, params)) return false;
  const int device = q.device().index;
  weave::cuda::DeviceGuard guard(device);
  auto build = [&](cudnnHandle_t handle, bool accumulate_dq) {
    GraphBuilder g;
    backward_graph(g, grad, q, k, v, out, lse, dq, dk, dv, params.causal, accumulate_dq);
    auto plan = make_plan(g, handle);
    plan->accumulates_dq = accumulate_dq;
    return plan;
  };
  Entry& entry =
      entry_for(key_of(1, params.causal, {&grad, &q, &k, &v, &out, &lse, &dq, &dk, &dv}), device,
                [&](cudnnHandle_t handle) {
                  try {  // the same bits on every run where cuDNN can; atomics where it cannot
                    return build(handle, false);
                  } catch (const Declined& declined) {
                    if (debugging())
                      std::fprintf(stderr, "weave: cuDNN's deterministic attention backward: %s\n",
                                   declined.why.c_str());
                    return build(handle, true);
                  }
                });
  const float scale = float(params.scale), one = 1.f, masked = minus_infinity();
  auto run = [&] {
    Tensor row_dot = empty(lse.shape(), {.dtype = kFloat32, .device = q.device()}), dq_sum;
    std::vector<std::pair<int64_t, const void*>> bindings{
        {kQ, q.data_ptr()},        {kK, k.data_ptr()},
        {kV, v.data_ptr()},        {kO, out.data_ptr()},
        {kGradO, grad.data_ptr()}, {kStats, lse.data_ptr()},
        {kGradQ, dq.data_ptr()},   {kGradK, dk.data_ptr()},
        {kGradV, dv.data_ptr()},   {kRowDot, row_dot.data_ptr()},
        {kScale, &scale},          {kOne, &one}};
    if (params.causal) bindings.push_back({kMinusInf, &masked});
    if (entry.plan->accumulates_dq) {
      dq_sum = empty(dq.shape(), {.dtype = kFloat32, .device = q.device()});
      if (cudnnGetVersion() < 90600)  // later versions clear it themselves
        WEAVE_CHECK_CALL(
            cudaMemsetAsync(dq_sum.data_ptr(), 0, dq_sum.numel() * sizeof(float),
                            static_cast<cudaStream_t>(weave::cuda::stream_handle(device))),
            "scaled_dot_product_attention");
      bindings.push_back({kGradQSum, dq_sum.data_ptr()});
    }
    execute(*entry.plan, handle_for(device), q.device(), bindings);
  };
  if (!choose_cudnn(requested, entry, device, run,
                    [&] { flash_attention_backward(grad, q, k, v, params, out, lse, dq, dk, dv); }))
    return false;
  run();
  return true;
}

}  // namespace weave::kernels::cuda
