// The core attention the transformer layers of nn/ take over a context group (nn/leaves.h).
#include "weave/ops/ops.h"
#include "weave/parallel/core/placement.h"
#include "weave/parallel/model_parallel/context_parallel.h"

namespace weave::parallel {

Tensor ContextAttention::attend(const Tensor& q, const Tensor& k, const Tensor& v,
                                const AttentionOptions& options) const {
  WEAVE_CHECK(!options.mask.defined() && options.dropout_p == 0, "ContextAttention",
              "attention over a context group takes no mask and no dropout");
  WEAVE_CHECK(!options.query_start, "ContextAttention",
              "attention over a context group places its queries itself; hint: leave "
              "query_start unset");
  return context_attention(q, k, v, split_,
                           {.causal = options.causal,
                            .scale = options.scale,
                            .window = options.window,
                            .softcap = options.softcap,
                            .document_ids = options.document_ids});
}

Tensor ContextAttention::positions(int64_t start, int64_t length, Device device) const {
  const Tensor whole = position_ids(start, length * split_.group.size(), device);
  return shard_sequence(whole, 0, split_.group, split_.layout);
}

void ContextAttention::check(const char* layer, bool decoding, bool dropout) const {
  WEAVE_CHECK(!decoding && !dropout, layer,
              "context parallelism runs without attention dropout and without a key/value "
              "cache; hint: decode with a model built without a context group (the same "
              "parameters), and train without attention dropout");
}

void ContextAttention::place(const nn::Module& layer) const {
  record_context_reads(layer, split_.group);
}

std::shared_ptr<const nn::CoreAttention> context_parallel(ContextSplit split) {
  return std::make_shared<ContextAttention>(std::move(split));
}

}  // namespace weave::parallel
