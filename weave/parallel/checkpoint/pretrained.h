#pragma once
// Hugging Face checkpoints into models split over ranks: each rank reads only the parts its
// parameters hold, with ranged reads: tensor-parallel slices (their placements' Split cuts) and
// FSDP's flat shards (whose layouts say which elements of which parameters they hold), or both.
//
//   models::Llama model(options, models::ModelSplit::from_mesh(mesh));
//   parallel::load_pretrained(model, data::hf::read_config(dir), dir);   // this rank's slices
//
//   parallel::FullyShardedDataParallel fsdp(*model, {.group = mesh.data()});
//   parallel::load_pretrained(fsdp.sharded_module(), config, dir);      // this rank's shards
//   ... train ...
//   parallel::save_pretrained(fsdp.sharded_module(), config, "tuned/");  // one parameter at a time
#include <functional>
#include <string>

#include "weave/data/hf/hf_checkpoint.h"
#include "weave/distributed/distributed.h"

namespace weave::parallel {

/// Loads each of model's parameters' parts from dir (data::hf::WeightReader), in the
/// parameter's dtype and device; what pads (a flat shard's end, a padded vocabulary's rows) is
/// left as it is. Raises as the reader does, for a parameter that is no part of the
/// architecture's tensors (or of a shape the config does not give), and for experts (a Hugging
/// Face GPT-2 or Llama has none); `options` as data::hf::load_weights takes them. Collective over
/// `group` (one agreement at the end): each rank reads other parts, so one may meet a bad tensor
/// that the others never read; then every rank raises, the others naming the group.
data::hf::LoadStats load_pretrained(nn::Module& model, const data::hf::ModelConfig& config,
                                    const std::string& dir,
                                    const dist::Group& group = dist::world(),
                                    const data::hf::LoadOptions& options = {});

/// Writes a model split over the ranks of `group` (tensor-parallel slices, FSDP's
/// sharded_module(), pipeline stages, replicas, or any mix) as one Hugging Face checkpoint in
/// dir, as data::hf::save_pretrained writes a whole model, one parameter at a time: each is put
/// together at group rank 0 from the ranks that hold its elements (each element sent once, by
/// the lowest rank that holds it), written, and dropped. So rank 0 holds its own parts plus one
/// whole parameter (and the writer's 16 MB conversion pieces), the other ranks their parts.
/// Collective over `group`, which must take in every rank that holds a part: an agreement per
/// parameter, so that an error on any rank (a failed write on rank 0, an element no rank holds)
/// raises on every rank; a failed export leaves no partial file.
void save_pretrained(nn::Module& model, const data::hf::ModelConfig& config, const std::string& dir,
                     const data::hf::SaveOptions& options = {},
                     const dist::Group& group = dist::world());

/// The whole model's parameters and buffers by weave's names, put together at group rank 0 as
/// save_pretrained puts them together (from slices, FSDP's sharded_module(), pipeline stages,
/// replicas, or any mix; of a padded vocabulary the real rows: the whole model's shapes), one
/// tensor at a time; empty on the other ranks. For decoding or inspecting a split model with no
/// checkpoint on disk: rank 0 then holds the whole model. Collective over `group`, which must take
/// in every rank that holds a part; raises on every rank as save_pretrained does.
///
///   nn::NamedTensors state = parallel::gather_whole_state_dict(fsdp.sharded_module());
///   if (dist::rank() == 0) whole.load_state_dict(state);
///
/// With `keep`, only the tensors whose names it keeps (a model's adapters: nn/lora.h).
nn::NamedTensors gather_whole_state_dict(
    nn::Module& model, const dist::Group& group = dist::world(),
    const std::function<bool(const std::string&)>& keep = nullptr);

/// The whole model's gradients by weave's parameter names, put together at group rank 0 as
/// gather_whole_state_dict puts the values together (from slices, FSDP's sharded_module()
/// shards, pipeline stages, experts); a parameter without a gradient counts as zeros; empty on
/// the other ranks. What parallel::verify_layout compares with one process's gradients.
/// Collective over `group`, as gather_whole_state_dict.
nn::NamedTensors gather_whole_gradients(nn::Module& model,
                                        const dist::Group& group = dist::world());

}  // namespace weave::parallel
