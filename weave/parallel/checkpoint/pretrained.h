#pragma once
// Hugging Face checkpoints into models split over ranks: each rank reads only the slices its
// parameters hold (their placements' tensor-parallel splits), with ranged reads.
//
//   parallel::ParallelLlamaModel model(options, mesh.tensor());
//   auto stats = parallel::load_pretrained(model, data::hf::read_config(dir), dir);
//
// A fully sharded model loads whole first (data::hf::from_pretrained on every rank), then
// FullyShardedDataParallel shards it: a FlatShard cut here raises.
#include <string>

#include "weave/data/hf_checkpoint.h"

namespace weave::parallel {

/// data::hf::load_weights with each parameter's tensor-parallel slice; local work (no
/// collective). Raises for parameters that experts or flat shards cut.
data::hf::LoadStats load_pretrained(nn::Module& model, const data::hf::ModelConfig& config,
                                    const std::string& dir);

}  // namespace weave::parallel
