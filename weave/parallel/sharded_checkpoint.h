#pragma once
// Sharded checkpoints for data-, ZeRO- and tensor-parallel runs: every rank of a group saves
// what it holds (its TrainingState: a tensor-parallel shard of the model, a ZeRO shard of the
// optimizer, its loader position), collectively.
//
//   parallel::save_sharded_checkpoint("run/ckpt", state);   // every rank of the world calls it
//   parallel::load_sharded_checkpoint("run/ckpt", state);   // same world size
//
// On disk: one safetensors file per rank ("rank-00001-of-00004.g7.safetensors", g7 the
// generation) and "index.json", which names the files of the last complete save. The index is
// replaced (atomically) only after every rank's file is durable, and the previous generation's
// files are deleted only then: a crash at any instant leaves a loadable checkpoint. With
// `single_file`, group rank 0 gathers every rank's contents into one file instead (tensors
// "rank<r>/<name>"), which loads at the same world size.
//
// Loading is all or nothing across the group: every rank checks its part first, and if any
// rank's check fails, every rank raises and none changes anything.
#include <string>

#include "weave/data/checkpoint.h"
#include "weave/distributed/distributed.h"

namespace weave::parallel {

struct ShardedCheckpointOptions {
  /// Gather everything into one file on group rank 0 instead of one file per rank.
  bool single_file = false;
  /// Copy the state to host memory and return; a background thread serializes and writes this
  /// rank's file. The save is committed (its index replaced, the older generation deleted) by
  /// the next save, a load, wait_for_checkpoint() or finalize(), whichever comes first; until
  /// then the previous generation is the one that loads, also after a crash.
  bool async = false;
};

/// Collective over `group`. Raises on every rank if any rank fails to write (an asynchronous
/// save's write error is raised by the call that commits it).
///
///   parallel::save_sharded_checkpoint("run/ckpt", state, dist::world(), {.async = true});
///   train_more();                        // the write goes on meanwhile
///   parallel::wait_for_checkpoint();     // committed (or its error raised on every rank)
void save_sharded_checkpoint(const std::string& dir, const data::TrainingState& state,
                             const dist::Group& group = dist::world(),
                             ShardedCheckpointOptions options = {});
/// Waits for this process's asynchronous save, if any, and commits it. Collective over that
/// save's group.
void wait_for_checkpoint();
/// Collective over `group` (of the size the checkpoint was saved at).
void load_sharded_checkpoint(const std::string& dir, data::TrainingState& state,
                             const dist::Group& group = dist::world());

}  // namespace weave::parallel
