#pragma once
// Where a saved tensor's elements belong (internal): a sharded checkpoint records, for every
// tensor a rank saves, which elements of which whole ("global") tensor it holds, so that a load
// at another layout finds them.
//
//   layout                     what rank r saves of "fc.weight" [8, 4]
//   data parallel (replicas)   all of it:                     whole box, elements [0, 32)
//   tensor parallel, 2 ranks   rows [4r, 4r + 4):             box rows [4r, 4r + 4), [0, 16)
//   ZeRO-1 / FSDP flat shard   elements [a, b) of the flattened parameters: one piece per
//                              member it overlaps, each a range of that member's box
//
// The global tensors are "model/<parameter>" and "optimizer/<slot>/<parameter>": an optimizer's
// state is placed as its parameter is.
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "weave/data/checkpoint.h"
#include "weave/parallel/core/placement.h"

namespace weave::parallel::detail {

/// Elements of one global tensor that a saved tensor holds: the box is the global tensor cut to
/// [begin, begin + length) along `axis` (the whole tensor when axis is -1), and the piece is
/// elements [first, first + count) of the box in row-major order, stored from element `offset`
/// of the saved tensor on.
struct Piece {
  std::string tensor;
  Shape shape;
  int axis = -1;
  int64_t begin = 0, length = 0;
  int64_t first = 0, count = 0;
  int64_t offset = 0;
};
/// A saved tensor's pieces, in the order of its elements.
using Pieces = std::vector<Piece>;

/// The pieces of the tensors data::checkpoint_contents(state) holds, by their names there
/// ("model/fc.weight", "optimizer/exp_avg.3"). A tensor with no global meaning (the loader's
/// order, optimizer state of a tensor outside the model) has none: it belongs to its rank.
std::map<std::string, Pieces> pieces_of(const data::TrainingState& state);
/// What pieces_of builds on: the model's tensors by their checkpoint names ("model/<name>"),
/// and each of the optimizer's parameters by parameter names ("fc.weight", no prefix; none for a
/// parameter outside the model), which its state of any slot takes.
struct StatePieces {
  std::map<std::string, Pieces> model;
  std::vector<std::optional<Pieces>> params;
};
StatePieces describe_state(const data::TrainingState& state);

/// The pieces as text (JSON, the files' "weave.placement" metadata), and back; a malformed text
/// raises naming `source`.
std::string pieces_text(const std::map<std::string, Pieces>& pieces);
std::map<std::string, Pieces> parse_pieces(const std::string& text, const std::string& source);

/// `count` consecutive elements of a global tensor (row-major) from element `global`, held from
/// element `local` of the saved tensor on.
struct Run {
  int64_t global, count, local;
};
/// A piece's elements as runs of the global tensor, in order.
std::vector<Run> runs_of(const Piece& piece);

}  // namespace weave::parallel::detail
