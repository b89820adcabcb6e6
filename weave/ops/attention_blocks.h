#pragma once
// Attention through matrix products over blocks of heads (internal to ops/attention.cpp): each
// block's scores are materialized, softmaxed and multiplied with cuBLAS-backed matmuls, and
// recomputed in backward from the saved log-sum-exp. It serves float32 and float64 on CUDA,
// where the fused CUDA-core kernels run far below what matrix units and cuBLAS reach; each
// block's scores stay under a fixed budget, so memory stays bounded at any length.
#include "weave/kernels/kernels.h"
#include "weave/tensor/tensor.h"

namespace weave::detail {

/// Whether attention on these operands (as the kernels get them) takes the blocked path: no
/// mask, no dropout, and no query row left without keys.
bool attention_by_blocks(const Tensor& q, const Tensor& k, const Tensor& mask,
                         const kernels::AttentionParams& params);

/// Forward into out [B, H, Tq, Dv] (any strides) and lse [B, H, Tq] (contiguous).
void blocked_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                       const kernels::AttentionParams& params, const Tensor& out,
                       const Tensor& lse);

/// Backward into dq, dk, dv (any strides), from the forward's out and lse.
void blocked_attention_backward(const Tensor& grad, const Tensor& q, const Tensor& k,
                                const Tensor& v, const kernels::AttentionParams& params,
                                const Tensor& out, const Tensor& lse, const Tensor& dq,
                                const Tensor& dk, const Tensor& dv);

/// Tests only: take the blocked path on every device (for the CPU to check it against the
/// fused kernels), with blocks of at most block_bytes of scores (0: the default budget).
void set_attention_by_blocks_everywhere(bool on, int64_t block_bytes = 0);

}  // namespace weave::detail
