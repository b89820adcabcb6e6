#pragma once
// Hugging Face checkpoints into models split over ranks: each rank reads only the parts its
// parameters hold, with ranged reads: tensor-parallel slices (their placements' Split cuts) and
// FSDP's flat shards (whose layouts say which elements of which parameters they hold), or both.
//
//   parallel::ParallelLlamaModel model(options, mesh.tensor());
//   parallel::load_pretrained(model, data::hf::read_config(dir), dir);   // this rank's slices
//
//   parallel::FullyShardedDataParallel fsdp(*model, {.group = mesh.data()});
//   parallel::load_pretrained(fsdp.sharded_module(), config, dir);      // this rank's shards
#include <string>

#include "weave/data/hf_checkpoint.h"
#include "weave/distributed/distributed.h"

namespace weave::parallel {

/// Loads each of model's parameters' parts from dir (data::hf::WeightReader), in the
/// parameter's dtype and device; what pads (a flat shard's end, a padded vocabulary's rows) is
/// left as it is. Raises as the reader does, for a parameter that is no part of the
/// architecture's tensors (or of a shape the config does not give), and for experts (a Hugging
/// Face GPT-2 or Llama has none). Collective over `group` (one agreement at the end): each rank
/// reads other parts, so one may meet a bad tensor that the others never read; then every rank
/// raises, the others naming the group.
data::hf::LoadStats load_pretrained(nn::Module& model, const data::hf::ModelConfig& config,
                                    const std::string& dir,
                                    const dist::Group& group = dist::world());

}  // namespace weave::parallel
