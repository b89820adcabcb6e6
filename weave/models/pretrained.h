#pragma once
// Hugging Face checkpoints as weave models, whole or split: the model a config.json describes
// (models::Llama for Llama-family checkpoints, models::GPT2 for GPT-2), built and loaded in one
// call. Split over ranks, each rank reads only its parameters' parts (ranged reads).
//
//   auto model = models::from_pretrained("llama/");                                  // whole
//   auto part = models::from_pretrained("llama/", models::ModelSplit::from_mesh(mesh)); // split
//   ... fine-tune ...
//   models::save_pretrained(*part, data::hf::read_config("llama/"), "tuned/",
//                           {.tokenizer = &tokenizer});                      // any layout
#include <memory>
#include <optional>
#include <string>

#include "weave/data/hf/hf_checkpoint.h"
#include "weave/models/model_split.h"
#include "weave/nn/generation.h"

namespace weave::models {

/// The model of the configuration, split as `split` says, with weights drawn from `generator`
/// (to be loaded over: build it under nn::DeferredInit to draw nothing).
std::shared_ptr<nn::CausalLM> make_model(const data::hf::ModelConfig& config,
                                         const ModelSplit& split = {},
                                         Generator* generator = nullptr);

/// make_model under nn::DeferredInit, then dir's weights: each parameter allocated as it is
/// read, so that loading peaks at the model's size (this rank's part of it). Split, it is
/// collective over `group` (the world when unset; parallel::load_pretrained: every rank raises
/// if one meets a bad tensor). `options` as data::hf::load_weights takes them: by default a
/// checkpoint with tensors the config does not account for, or with non-finite values, raises.
std::shared_ptr<nn::CausalLM> from_pretrained(const std::string& dir, const ModelSplit& split = {},
                                              const std::optional<dist::Group>& group = {},
                                              const data::hf::LoadOptions& options = {});

/// Writes `model` as one Hugging Face checkpoint in dir (with options.tokenizer its files too),
/// whatever its layout: whole on one process (data::hf::save_pretrained), or under dist::init()
/// put together one parameter at a time from the ranks of `group` (the world when unset) that
/// hold its pieces: tensor-parallel slices, FSDP's sharded_module(), pipeline stages, replicas
/// (parallel::save_pretrained; every rank raises if one fails). Collective over `group` then.
void save_pretrained(nn::Module& model, const data::hf::ModelConfig& config, const std::string& dir,
                     const data::hf::SaveOptions& options = {},
                     const std::optional<dist::Group>& group = {});

}  // namespace weave::models
