#pragma once
// Sharded checkpoints for data-, ZeRO- and tensor-parallel runs: every rank of a group saves
// what it holds (its TrainingState: a tensor-parallel shard of the model, a ZeRO shard of the
// optimizer, its loader position), collectively.
//
//   parallel::save_sharded_checkpoint("run/ckpt", state);   // every rank of the world calls it
//   parallel::load_sharded_checkpoint("run/ckpt", state);   // at any world size and layout
//
// On disk: one safetensors file per rank ("rank-00001-of-00004.g7.safetensors", g7 the
// generation) and "index.json", which names the files of the last complete save. The index is
// replaced (atomically) only after every rank's file is durable, and the previous generation's
// files are deleted only then: a crash at any instant leaves a loadable checkpoint. From the
// choice of its generation to its commit, a save holds the directory's lock
// (".weave-save.lock", an flock the kernel releases if the holder dies): a second job that
// saves into the same directory meanwhile raises, naming the holder, on every rank of its
// group, instead of interleaving its files with the first job's. With
// `single_file`, group rank 0 gathers every rank's contents into one file instead (tensors
// "rank<r>/<name>").
//
// Every file records each tensor's placement: its global name ("model/fc.weight",
// "optimizer/exp_avg/fc.weight"), global shape, and which elements this rank held (replicated,
// split along an axis by a tensor-parallel layer, or a flat slice of ZeRO-1's or FSDP's
// flattened parameters). A load plans, per rank, which elements its state needs now, reads
// only the checksum blocks that hold them (ranged reads), and fills its parameters and
// optimizer state: data parallel, ZeRO-1, FSDP and tensor parallel at any sizes whose layout
// divides the shapes. A data loader with a DistributedSampler over another number of replicas
// resumes the epoch at the same place of its global order, split anew. Counters, generators and
// user values come from the part of rank (this rank mod the saved world size).
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
  /// rank's file and, as soon as every rank's is written, commits the save (its index
  /// replaced, the older generation deleted) on a duplicate of the group (dist::duplicate),
  /// beside the training's collectives. A crash loses at most the save in flight: until the
  /// commit the previous generation is the one that loads. The next save, a load,
  /// wait_for_checkpoint() and finalize() wait for it and raise its error on every rank.
  bool async = false;
};

/// Collective over `group`. Raises on every rank if any rank fails to write (an asynchronous
/// save's error is raised by the next call that waits for it).
///
///   parallel::save_sharded_checkpoint("run/ckpt", state, dist::world(), {.async = true});
///   train_more();                        // the write goes on meanwhile
///   parallel::wait_for_checkpoint();     // committed (or its error raised on every rank)
void save_sharded_checkpoint(const std::string& dir, const data::TrainingState& state,
                             const dist::Group& group = dist::world(),
                             ShardedCheckpointOptions options = {});
/// Waits until this process's asynchronous save, if any, is written and committed, and raises
/// its error (on every rank of its group alike).
void wait_for_checkpoint();
/// What a load read on this rank.
struct ShardedLoadReport {
  int saved_world_size = 0;
  /// From the checkpoint's files: every file's header, and the checksum blocks holding what
  /// this rank needs.
  int64_t bytes_read = 0;
  /// The bytes of the tensors this rank loaded.
  int64_t bytes_needed = 0;
};

/// Collective over `group`, of any size and layout: each rank reads what its state needs now
/// (see the top of this file). Raises on every rank, changing nothing, if any rank cannot load.
ShardedLoadReport load_sharded_checkpoint(const std::string& dir, data::TrainingState& state,
                                          const dist::Group& group = dist::world());

/// Loads the newest complete checkpoint in `dir` if there is one (returning true), else leaves
/// `state` as it is (false): the first line of a program that weave-run may restart.
/// Collective over `group`, which may be of another size and layout than the one that saved.
///
///   if (parallel::resume_from_latest(dir, state)) step = std::stoll(state.user.at("step"));
bool resume_from_latest(const std::string& dir, data::TrainingState& state,
                        const dist::Group& group = dist::world());

}  // namespace weave::parallel
