#pragma once
// What the FSDP suites share: a small float64 model of uneven units, each rank's slice of a
// global batch, the optimizer, and the distance between a reference model and FSDP's gathered
// parameters.
#include <doctest/doctest.h>

#include <memory>
#include <string>
#include <utility>

#include "weave/weave.h"

namespace weave::test::fsdp {

constexpr int64_t kLocalBatch = 4;

// Uneven units: 5 -> 16 -> 9 -> 3 (96, 153 and 30 elements).
inline std::shared_ptr<nn::Sequential> make_model(uint64_t seed) {
  manual_seed(seed);
  auto model = std::make_shared<nn::Sequential>(std::initializer_list<std::shared_ptr<nn::Module>>{
      std::make_shared<nn::Linear>(5, 16), nn::Tanh(), std::make_shared<nn::Linear>(16, 9),
      nn::Tanh(), std::make_shared<nn::Linear>(9, 3)});
  model->to(kFloat64);
  return model;
}

// Step `step`'s batch over every rank (kLocalBatch rows each), the same on every rank.
inline std::pair<Tensor, Tensor> global_batch(int step, int64_t in = 5, int64_t out = 3) {
  Generator g(777 + uint64_t(step));
  const int64_t rows = kLocalBatch * dist::world_size();
  Tensor x = randn({rows, in}, {.dtype = kFloat64}, &g),
         y = randn({rows, out}, {.dtype = kFloat64}, &g);
  return {x, y};
}

// This rank's rows of it.
inline std::pair<Tensor, Tensor> local_batch(int step, int64_t in = 5, int64_t out = 3) {
  auto [x, y] = global_batch(step, in, out);
  return {x.narrow(0, dist::rank() * kLocalBatch, kLocalBatch),
          y.narrow(0, dist::rank() * kLocalBatch, kLocalBatch)};
}

inline optim::AdamWOptions adamw_options() {
  return {.lr = 1e-2, .weight_decay = 0.05};
}

// `steps` AdamW steps of DDP (the reference) and FSDP side by side on the same local batches.
inline void train_side_by_side(parallel::DistributedDataParallel& ddp, optim::Optimizer& ddp_opt,
                               parallel::FullyShardedDataParallel& fsdp, optim::Optimizer& opt,
                               int steps) {
  for (int step = 0; step < steps; ++step) {
    auto [x, y] = local_batch(step);
    ddp_opt.zero_grad();
    opt.zero_grad();
    mse_loss(ddp(x), y).backward();
    mse_loss(fsdp(x), y).backward();
    ddp_opt.step();
    opt.step();
  }
}

// The largest |a - b| over the reference's parameters and the FSDP model's gathered ones.
inline double max_difference(nn::Module& reference, parallel::FullyShardedDataParallel& fsdp) {
  const nn::NamedTensors full = fsdp.full_state_dict();
  double worst = 0;
  for (const auto& entry : reference.named_parameters()) {
    const std::string& name = entry.first;
    bool found = false;
    for (const auto& [n, t] : full)
      if (n == name) {
        found = true;
        worst = std::max(worst, weave::abs(t - entry.second.detach()).max().item<double>());
      }
    CHECK_MESSAGE(found, name);
  }
  return worst;
}

}  // namespace weave::test::fsdp
