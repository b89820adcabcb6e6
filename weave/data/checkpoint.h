#pragma once
// Training checkpoints: model, optimizer, LR scheduler, data loader position and random
// generators in one safetensors file, replaced atomically, restored exactly.
//
//   data::TrainingState state{.model = &model, .optimizer = &adam, .loader = &loader};
//   data::save_checkpoint("run/last.safetensors", state);       // a crash keeps the old file
//   ...
//   data::load_checkpoint("run/last.safetensors", state);       // training resumes bit-exact
//
// The file holds tensors "model/<name>", "optimizer/<name>" and "loader/order", and metadata
// "weave.checkpoint" (the format version), "optimizer" (its numbers, JSON), "scheduler.step",
// "loader" (JSON), "rng.default" and "user.<key>". Loading is strict: a missing, unexpected or
// mismatched entry raises naming it, and nothing is changed.
#include <functional>

#include "weave/data/dataloader.h"
#include "weave/data/safetensors.h"
#include "weave/optim/schedule.h"

namespace weave::data {

/// What a checkpoint covers; leave out (null) what a run does not have.
struct TrainingState {
  nn::Module* model = nullptr;
  optim::Optimizer* optimizer = nullptr;
  optim::LRScheduler* scheduler = nullptr;
  DataLoader* loader = nullptr;
  /// The process-wide default generator (dropout, init): saved and restored.
  bool default_generator = true;
  /// Your own values (epoch, best score, ...): saved as they are; load_checkpoint fills it.
  Metadata user = {};
};

void save_checkpoint(const std::string& path, const TrainingState& state);
void load_checkpoint(const std::string& path, TrainingState& state);

/// The checkpoint's contents in memory (what save_checkpoint writes), and restoring from them
/// (what load_checkpoint does after reading the file; `name` names the source in errors).
/// `before_changes`, when given, runs after every check passed and before anything changes (a
/// sharded load uses it to learn whether every rank's checks passed).
SafetensorsFile checkpoint_contents(const TrainingState& state);
void restore_checkpoint(const SafetensorsFile& contents, TrainingState& state,
                        const std::string& name,
                        const std::function<void()>& before_changes = nullptr);

/// The loader state a checkpoint's "loader" metadata holds, all but the order (a tensor of its
/// own); the split fields stay -1 where an older checkpoint recorded none. Raises on text that
/// is not one (`name` names the source).
LoaderState parse_loader_metadata(const std::string& text, const std::string& name);

}  // namespace weave::data
