#pragma once
// Load-time resharding (internal): from the headers of a sharded checkpoint's files and the
// placements they record, which bytes of which file this rank needs for the layout it has now.
// Local work only; sharded_checkpoint.cpp runs the agreements around it.
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "weave/data/checkpoint.h"
#include "weave/parallel/checkpoint/saved_pieces.h"

namespace weave::parallel::detail {

/// One saving rank's part of a checkpoint: its file's header (shared with the other ranks' parts
/// in a single-file checkpoint, where names carry the prefix "rank<r>/").
struct SavedPart {
  int rank = 0;
  std::shared_ptr<const data::SafetensorsHeader> header;
  std::string prefix;
  std::map<std::string, const data::SafetensorsEntry*> entries;  // by name, prefix removed
  data::Metadata metadata;                                       // prefix removed
  std::map<std::string, Pieces> pieces;
};

/// The generation in the name of a checkpoint's file ("rank-00001-of-00004.g7.safetensors" or
/// "all-00004-ranks.g7.safetensors": 7), or -1 for any other name.
int64_t generation_of(const std::string& file_name);

/// The parts of a checkpoint saved by `saved_size` ranks, from its files' headers (one per rank,
/// or one for all).
std::vector<SavedPart> saved_parts(
    std::vector<std::shared_ptr<const data::SafetensorsHeader>> files, bool single_file,
    int saved_size);

/// What this rank loads: the contents restore_checkpoint takes (tensors allocated, filled by
/// read_planned), and the byte ranges that fill them.
struct LoadPlan {
  data::SafetensorsFile contents;
  std::vector<std::pair<const data::SafetensorsHeader*, std::vector<data::ByteRange>>> reads;
  /// The global tensors this rank reads from (sorted): every one the checkpoint holds must be
  /// wanted by some rank, or the checkpoint is another model's.
  std::vector<std::string> wanted;
  int64_t bytes_needed = 0;
};

/// Plans rank `rank` of `size` loading `parts` into `state`. Raises, naming the tensor, when the
/// checkpoint lacks something the state needs (another model, a missing shard), holds it in
/// another shape or dtype, or holds replicas that differ.
LoadPlan plan_load(const std::vector<SavedPart>& parts, const data::TrainingState& state, int rank,
                   int size, const std::string& dir);

/// One read of a tensor plan: `count` elements from element `source_element` of saved piece
/// `source` (in the order given) into element `local` of the target.
struct ElementRead {
  size_t source;
  int64_t source_element, local, count;
};
/// How one wanted piece is read: the reads, and the runs of it no saved piece holds.
struct TensorPlan {
  std::vector<ElementRead> reads;
  std::vector<Run> missing;
};
/// Plans `want` from saved pieces, each given as its runs (sorted by global element), in order of
/// preference: every element of `want` is read from the first piece that holds it.
TensorPlan plan_tensor(const Piece& want, const std::vector<std::vector<Run>>& sources);

/// The global tensors the parts hold (sorted).
std::vector<std::string> saved_globals(const std::vector<SavedPart>& parts);

/// Reads what the plan names (verifying checksums); returns the bytes read.
int64_t read_planned(LoadPlan& plan);

}  // namespace weave::parallel::detail
