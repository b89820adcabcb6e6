#pragma once
// --verify-layout: the flags' layout checked against one process (parallel::verify_layout) on a
// shrunken float64 copy of the flags' model, one step of the same wrapping, sampler, sequence
// cut, loss, clipping and AdamW groups as the training run; the first thing to run after
// choosing a new combination of axes.
#include <weave/weave.h>

#include "flags.h"
#include "model.h"
#include "stepper.h"

#include <chrono>
#include <cstdio>
#include <memory>

namespace gpt {

/// The flags' model shrunk for the check: at most 2 layers (one per pipeline stage), 8
/// dimensions per head, short windows that the context ranks' zig-zag parts divide, and a batch
/// of 2 rows per data rank and pipeline micro-batch.
inline Flags shrunk(const Flags& f, const parallel::ProcessMesh& mesh) {
  Flags s = f;
  s.layers = std::max<int64_t>(f.pipeline, std::min<int64_t>(f.layers, 2));
  s.dim = 8 * f.heads;
  s.ffn = 4 * s.dim;
  s.context = 8 * f.context_parallel;
  s.microbatches = f.pipeline > 1 ? 2 : 0;
  s.batch = 2 * mesh.shape().data * std::max(1, s.microbatches);
  s.param_dtype = std::nullopt;  // float64 throughout: every correct layout agrees to 1e-10
  s.reproducible = false;
  s.checkpoint_activations = false;
  s.cuda_graph = false;
  return s;
}

/// Runs the check; prints the report (rank 0) and returns 0 when it passed, 1 otherwise.
inline int verify_layout(const Flags& flags) {
  const parallel::ProcessMesh mesh = mesh_of(flags);
  const Flags f = shrunk(flags, mesh);
  constexpr int64_t kVocab = 50;  // not a multiple of 4: vocabulary pieces are padded
  const auto split = [&f](const parallel::ProcessMesh* m) {
    return m ? split_of(f, *m) : models::ModelSplit{};
  };
  parallel::LayoutRecipe recipe;
  recipe.model = [&](const parallel::ProcessMesh* m) {
    std::shared_ptr<nn::Module> model = make_model(f, kVocab, split(m));
    initialize(*model);
    return model;
  };
  recipe.wrap = [&](nn::Module& part, const parallel::ProcessMesh& m) {
    parallel::DataParallelOptions options = wrapping(f, m);
    options.fsdp.reduce_dtype = options.fsdp.output_dtype = std::nullopt;  // float64 throughout
    return parallel::data_parallel(part, m, options);
  };
  recipe.shard = [&](const parallel::LayoutBatch& whole, const parallel::ProcessMesh& m) {
    const int64_t rows = whole.targets.size(0) / m.shape().data, first = m.data_rank() * rows;
    const models::ModelSplit s = split(&m);
    return parallel::LayoutBatch{s.local_inputs(whole.inputs.x.narrow(0, first, rows)),
                                 s.local_sequence(whole.targets.narrow(0, first, rows))};
  };
  recipe.loss = [&](const Tensor& logits, const Tensor& targets, const parallel::ProcessMesh* m) {
    return objective(split(m), logits, targets);
  };
  recipe.optimizer = [&](nn::Module& model, parallel::DataParallelWrapper* wrapper) {
    return std::unique_ptr<optim::Optimizer>(make_adamw(f, model, wrapper));
  };
  recipe.max_norm = 1e-3;  // below the gradients' norm: the step clips
  if (f.strategy == "zero")
    recipe.averaging_optimizer = [&](nn::Module& part, const parallel::ProcessMesh& m) {
      std::shared_ptr<parallel::ZeroRedundancyOptimizer> zero =
          make_zero(f, part, m, recipe.max_norm);
      return std::function<double()>([zero] {
        zero->step();
        return zero->last_grad_norm();
      });
    };
  recipe.microbatches = f.microbatches;
  recipe.seed = f.seed;
  Generator generator(f.seed + 1);
  const Tensor tokens = randint(0, kVocab, {f.batch, f.context + 1}, {.dtype = kInt64}, &generator);
  const auto start = std::chrono::steady_clock::now();
  const parallel::LayoutReport report =
      parallel::verify_layout(mesh, recipe,
                              {.inputs = tokens.narrow(1, 0, f.context).contiguous(),
                               .targets = tokens.narrow(1, 1, f.context).contiguous()});
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (dist::rank() == 0)
    std::printf("verify-layout: %s, %s: %s (%.2f s)\n", f.arch.c_str(), mesh.str().c_str(),
                report.str().c_str(), seconds);
  return report.passed ? 0 : 1;
}

}  // namespace gpt
