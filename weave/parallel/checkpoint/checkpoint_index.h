#pragma once
// A sharded checkpoint's index.json (internal): what save_sharded_checkpoint commits, and what
// load_sharded_checkpoint and weave-ckpt read, validated in one place, so that "weave-ckpt says
// ok" means "it loads". A save's files are tied to its index by a save id in every file and by
// each file's CRC-32 in the index.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "weave/data/safetensors.h"

namespace weave::parallel::detail {

inline constexpr const char* kCheckpointFormat = "weave-sharded-2";
/// The first format: no placements, so it loads at the world size it was saved at only.
inline constexpr const char* kCheckpointFormatWithoutPlacements = "weave-sharded-1";
/// The metadata key of the save id in every file of a save.
inline constexpr const char* kSaveIdKey = "weave.save_id";

struct CheckpointIndex {
  std::string format = kCheckpointFormat;
  int world_size = 0;
  int64_t generation = 0;
  bool single_file = false;
  std::vector<std::string> files;   // one per saving rank, or one (single_file)
  std::string save_id;              // empty in saves that predate save ids
  std::vector<uint32_t> checksums;  // each file's CRC-32, whole (empty: predates them)

  bool has_placements() const { return format == kCheckpointFormat; }
  /// The index.json text.
  std::string dump() const;
};

/// Reads dir/index.json and checks it as the loader needs it: a known format, a positive world
/// size, one plain file name per saving rank (or one), and well-formed ids and checksums.
/// Raises weave::Error naming the file and the first problem.
CheckpointIndex read_checkpoint_index(const std::string& dir);

/// Each listed file's header, checked to belong to the index's save (its save id).
std::vector<std::shared_ptr<const data::SafetensorsHeader>> read_checkpoint_headers(
    const std::string& dir, const CheckpointIndex& index);

/// Reads every listed file whole and checks it: its CRC-32 against the index, its save id, and
/// its tensors' own checksums. Returns the bytes read.
int64_t verify_checkpoint_files(const std::string& dir, const CheckpointIndex& index);

}  // namespace weave::parallel::detail
