// Saved pieces: a TrainingState described through the placements its tensors carry (their
// Split cuts and flat-shard layouts), and pieces as runs of global elements.
#include "weave/parallel/checkpoint/saved_pieces.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <optional>

#include "weave/parallel/core/placement.h"

namespace weave::parallel::detail {

namespace {

using json = nlohmann::json;

// The one piece of a parameter saved whole (cut by its tensor-parallel split, if any). Of a
// padded whole (TensorSplit::size) only the real rows: a prefix of the parameter, maybe empty.
Piece whole(const std::string& name, const Shape& local, const TensorSplit& split) {
  Piece piece{name, local, -1, 0, 0, 0, local.numel(), 0};
  if (split.axis >= 0 && split.count > 1) {
    piece.axis = split.axis;
    piece.length = local[split.axis];
    piece.begin = split.index * piece.length;
    piece.shape[split.axis] = piece.length * split.count;
    if (split.size >= 0) {
      WEAVE_CHECK(split.axis == 0, "sharded checkpoint",
                  "{} is padded along axis {}; only a split along axis 0 pads", name, split.axis);
      piece.shape[0] = split.size;
      piece.length = std::clamp<int64_t>(split.size - piece.begin, 0, piece.length);
      piece.count = piece.length * (local.numel() / local[0]);
    }
  }
  return piece;
}

Pieces with_prefix(Pieces pieces, const std::string& prefix) {
  for (Piece& piece : pieces) piece.tensor = prefix + piece.tensor;
  return pieces;
}

// Describes tensors of a TrainingState by the names of its model's parameters.
class Describer {
 public:
  explicit Describer(const nn::Module* model) {
    if (!model) return;
    splits_ = tensor_splits(*model);
    for (const auto& [name, p] : model->named_parameters()) names_[p.impl()] = name;
  }

  // The pieces of `t` by parameter name (`name`, or found by identity); none if a name is missing.
  std::optional<Pieces> operator()(const Tensor& t, std::string name) const {
    if (const std::shared_ptr<const FlatShard> flat = flat_shard_of(t)) {
      Pieces out;
      const int64_t begin = flat->begin, end = begin + t.numel();
      for (size_t m = 0; m < flat->members.size(); ++m) {
        const int64_t from = flat->offsets[m], to = from + flat->shapes[m].numel();
        if (std::max(from, begin) >= std::min(to, end)) continue;
        std::string member = flat->names.empty() ? "" : flat->names[m];
        if (member.empty()) {
          auto it = names_.find(flat->members[m]);
          if (it == names_.end()) return std::nullopt;
          member = it->second;
        }
        Piece piece = whole(member, flat->shapes[m],
                            flat->splits.empty() ? split_of(member) : flat->splits[m]);
        // The member's elements in the shard, less a padded whole's padding (its last ones).
        const int64_t first = std::max(from, begin) - from;
        const int64_t last = std::min(std::min(to, end) - from, piece.count);
        if (first >= last) continue;
        piece.first = first, piece.count = last - first;
        piece.offset = from + first - begin;
        out.push_back(std::move(piece));
      }
      return out;
    }
    if (name.empty()) {
      auto it = names_.find(t.impl());
      if (it == names_.end()) return std::nullopt;
      name = it->second;
    }
    Piece piece = whole(name, t.shape(), split_of(name));
    if (piece.count == 0) return Pieces{};  // padding only
    return Pieces{std::move(piece)};
  }

 private:
  TensorSplit split_of(const std::string& name) const {
    auto it = splits_.find(name);
    return it == splits_.end() ? TensorSplit{} : it->second;
  }
  std::map<const void*, std::string> names_;  // the model's parameters by identity
  std::map<std::string, TensorSplit> splits_;
};

}  // namespace

StatePieces describe_state(const data::TrainingState& state) {
  StatePieces out;
  const Describer describe(state.model);
  if (state.model)
    for (const auto& [name, t] : state.model->state_dict())
      if (auto pieces = describe(t, name))
        out.model["model/" + name] = with_prefix(*pieces, "model/");
  if (state.optimizer)
    for (const Tensor& p : state.optimizer->params()) out.params.push_back(describe(p, ""));
  return out;
}

std::map<std::string, Pieces> pieces_of(const data::TrainingState& state) {
  StatePieces described = describe_state(state);
  std::map<std::string, Pieces> out = std::move(described.model);
  if (state.optimizer)
    for (const auto& [name, t] : state.optimizer->state_dict().tensors) {
      const size_t dot = name.rfind('.');
      const auto& pieces = described.params.at(std::stoul(name.substr(dot + 1)));
      if (pieces)
        out["optimizer/" + name] = with_prefix(*pieces, "optimizer/" + name.substr(0, dot) + "/");
    }
  return out;
}

std::string pieces_text(const std::map<std::string, Pieces>& saved) {
  json out = json::object();
  for (const auto& [name, pieces] : saved) {
    json list = json::array();
    for (const Piece& p : pieces)
      list.push_back({{"tensor", p.tensor},
                      {"shape", p.shape.vec()},
                      {"axis", p.axis},
                      {"begin", p.begin},
                      {"length", p.length},
                      {"first", p.first},
                      {"count", p.count},
                      {"offset", p.offset}});
    out[name] = list;
  }
  return out.dump();
}

std::map<std::string, Pieces> parse_pieces(const std::string& text, const std::string& source) {
  const json parsed = json::parse(text, nullptr, false);
  auto bad = [&](const std::string& why) {
    WEAVE_FAIL("load_sharded_checkpoint", "{}: its saved pieces (weave.placement) {}", source, why);
  };
  if (parsed.is_discarded() || !parsed.is_object()) bad("are not a JSON object");
  std::map<std::string, Pieces> out;
  for (const auto& [name, list] : parsed.items()) {
    if (!list.is_array()) bad(fmt::format("of '{}' are not a list", name));
    Pieces& pieces = out[name];
    for (const json& p : list) {
      const bool shaped = p.is_object() && p.contains("tensor") && p["tensor"].is_string() &&
                          p.contains("shape") && p["shape"].is_array() &&
                          p["shape"].size() <= size_t(kMaxDims);
      if (!shaped) bad(fmt::format("of '{}' lack a tensor name or shape", name));
      Piece piece;
      piece.tensor = p["tensor"].get<std::string>();
      for (const json& d : p["shape"]) {
        if (!d.is_number_integer() || d.get<int64_t>() < 0)
          bad(fmt::format("of '{}' hold a size that is not a non-negative integer", name));
        piece.shape.push_back(d.get<int64_t>());
      }
      for (const char* key : {"axis", "begin", "length", "first", "count", "offset"})
        if (!p.contains(key) || !p[key].is_number_integer())
          bad(fmt::format("of '{}' lack an integer '{}'", name, key));
      piece.axis = p["axis"].get<int>();
      piece.begin = p["begin"].get<int64_t>();
      piece.length = p["length"].get<int64_t>();
      piece.first = p["first"].get<int64_t>();
      piece.count = p["count"].get<int64_t>();
      piece.offset = p["offset"].get<int64_t>();
      // The box must lie in the tensor and the piece in the box.
      const int64_t numel = piece.shape.numel();
      int64_t box = numel;
      if (piece.axis != -1) {
        if (piece.axis < 0 || piece.axis >= int(piece.shape.size()) || piece.begin < 0 ||
            piece.length <= 0 || piece.begin + piece.length > piece.shape[piece.axis])
          bad(fmt::format("of '{}' cut {} along an axis it does not have", name, piece.tensor));
        box = numel / piece.shape[piece.axis] * piece.length;
      }
      if (piece.first < 0 || piece.count < 0 || piece.first + piece.count > box || piece.offset < 0)
        bad(fmt::format("of '{}' name elements outside {}", name, piece.tensor));
      pieces.push_back(std::move(piece));
    }
  }
  return out;
}

std::vector<Run> runs_of(const Piece& piece) {
  std::vector<Run> out;
  if (piece.count == 0) return out;
  if (piece.axis == -1) return {{piece.first, piece.count, piece.offset}};
  // The box is `outer` runs of `length * inner` elements, one per index of the axes before.
  int64_t inner = 1;
  for (int d = piece.axis + 1; d < int(piece.shape.size()); ++d) inner *= piece.shape[d];
  const int64_t row = piece.length * inner, stride = piece.shape[piece.axis] * inner;
  for (int64_t e = piece.first; e < piece.first + piece.count;) {
    const int64_t outer = e / row, within = e % row;
    const int64_t take = std::min(row - within, piece.first + piece.count - e);
    out.push_back(
        {outer * stride + piece.begin * inner + within, take, piece.offset + e - piece.first});
    e += take;
  }
  return out;
}

}  // namespace weave::parallel::detail
