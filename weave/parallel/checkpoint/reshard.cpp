// Load-time resharding: match the pieces this rank's state needs against the pieces the saved
// parts hold, and turn the overlaps into byte ranges of the files.
#include "weave/parallel/checkpoint/reshard.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <tuple>

namespace weave::parallel::detail {

namespace {

using json = nlohmann::json;
constexpr const char* kReshardOp = "load_sharded_checkpoint";
constexpr const char* kPlacementKey = "weave.placement";

// A saved piece of a global tensor: which part holds it, in which of its tensors, and its
// elements as runs of global elements.
struct Source {
  const SavedPart* part;
  const data::SafetensorsEntry* entry;
  Piece piece;
  std::vector<Run> runs;  // sorted by global element
};

// The saved sampler split recorded in a part's loader state, or (-1, -1).
std::pair<int, int> saved_split(const SavedPart& part) {
  auto it = part.metadata.find("loader");
  if (it == part.metadata.end()) return {-1, -1};
  const data::LoaderState loader = data::parse_loader_metadata(it->second, part.header->path);
  return {loader.replicas, loader.replica};
}

}  // namespace

int64_t generation_of(const std::string& file_name) {
  static const std::regex pattern(
      R"((?:rank-\d{5}-of-\d{5}|all-\d{5}-ranks)\.g(\d{1,18})\.safetensors)");
  std::smatch match;
  return std::regex_match(file_name, match, pattern) ? std::stoll(match[1]) : -1;
}

std::vector<SavedPart> saved_parts(
    std::vector<std::shared_ptr<const data::SafetensorsHeader>> files, bool single_file,
    int saved_size) {
  std::vector<SavedPart> parts(static_cast<size_t>(saved_size));
  for (int r = 0; r < saved_size; ++r) {
    SavedPart& part = parts[size_t(r)];
    part.rank = r;
    part.header = files.at(single_file ? 0 : size_t(r));
    part.prefix = single_file ? fmt::format("rank{}/", r) : "";
    for (const data::SafetensorsEntry& e : part.header->entries)
      if (e.name.rfind(part.prefix, 0) == 0) part.entries[e.name.substr(part.prefix.size())] = &e;
    for (const auto& [key, value] : part.header->metadata)
      if (key.rfind(part.prefix, 0) == 0) part.metadata[key.substr(part.prefix.size())] = value;
    const std::string source =
        single_file ? fmt::format("{} (rank {})", part.header->path, r) : part.header->path;
    auto text = part.metadata.find(kPlacementKey);
    WEAVE_CHECK(text != part.metadata.end(), kReshardOp,
                "{} records no saved pieces (weave.placement); hint: is it a part of a weave "
                "sharded checkpoint?",
                source);
    part.pieces = parse_pieces(text->second, source);
    part.metadata.erase(text);
    for (const auto& [name, pieces] : part.pieces) {
      auto entry = part.entries.find(name);
      WEAVE_CHECK(entry != part.entries.end(), kReshardOp,
                  "{} places tensor '{}', which it does not hold", source, name);
      for (const Piece& piece : pieces)
        WEAVE_CHECK(piece.offset + piece.count <= entry->second->shape.numel(), kReshardOp,
                    "{}: the saved pieces of '{}' run past its {} elements", source, name,
                    entry->second->shape.numel());
    }
  }
  return parts;
}

std::vector<std::string> saved_globals(const std::vector<SavedPart>& parts) {
  std::set<std::string> out;
  for (const SavedPart& part : parts)
    for (const auto& [name, pieces] : part.pieces)
      for (const Piece& piece : pieces) out.insert(piece.tensor);
  return {out.begin(), out.end()};
}

TensorPlan plan_tensor(const Piece& want, const std::vector<std::vector<Run>>& sources) {
  TensorPlan out;
  out.missing = runs_of(want);
  for (size_t k = 0; k < sources.size() && !out.missing.empty(); ++k) {
    const std::vector<Run>& have = sources[k];
    std::vector<Run> still;
    for (const Run& need : out.missing) {
      int64_t at = need.global;
      const int64_t end = need.global + need.count;
      // The first run of `have` that ends after `at`; runs are sorted by global element.
      auto it = std::upper_bound(have.begin(), have.end(), at,
                                 [](int64_t g, const Run& r) { return g < r.global + r.count; });
      for (; it != have.end() && it->global < end; ++it) {
        const int64_t from = std::max(at, it->global), to = std::min(end, it->global + it->count);
        if (from > at) still.push_back({at, from - at, need.local + (at - need.global)});
        out.reads.push_back(
            {k, it->local + (from - it->global), need.local + (from - need.global), to - from});
        at = to;
      }
      if (at < end) still.push_back({at, end - at, need.local + (at - need.global)});
    }
    out.missing = std::move(still);
  }
  return out;
}

namespace {

// plan_load's state: the saved pieces by global tensor, and the plan as it grows.
class Planner {
 public:
  Planner(const std::vector<SavedPart>& parts, const data::TrainingState& state, int rank, int size,
          const std::string& dir)
      : parts_(parts),
        state_(state),
        size_(size),
        dir_(dir),
        saved_(int(parts.size())),
        home_(rank % saved_),
        own_(&parts[size_t(home_)]) {}

  LoadPlan run() {
    collect_sources();
    const StatePieces pieces = describe_state(state_);
    if (state_.model)
      for (const auto& [name, t] : state_.model->state_dict()) {
        Tensor target = zeros(t.shape(), {.dtype = t.dtype()});  // a flat shard's padding stays 0
        fill(target, pieces.model.at("model/" + name), "model/" + name);
        add("model/" + name, target);
      }
    if (state_.optimizer) plan_optimizer(pieces.params);
    plan_metadata();
    if (state_.loader) plan_loader();
    check_copies_agree();
    plan_.wanted.assign(wanted_.begin(), wanted_.end());
    for (auto& [header, ranges] : reads_) plan_.reads.emplace_back(header, std::move(ranges));
    return std::move(plan_);
  }

 private:
  // This rank reads from its own part first (at the saved layout it holds everything), then
  // from the next ones: ranks that need the same replica read it from different files.
  int preference(const SavedPart* part) const { return (part->rank - home_ + saved_) % saved_; }

  // Every global tensor's saved pieces, in this rank's order of preference.
  void collect_sources() {
    for (const SavedPart& part : parts_)
      for (const auto& [name, pieces] : part.pieces)
        for (const Piece& piece : pieces)
          sources_[piece.tensor].push_back({&part, part.entries.at(name), piece, runs_of(piece)});
    for (auto& [global, list] : sources_) {
      std::stable_sort(list.begin(), list.end(), [&](const Source& a, const Source& b) {
        return preference(a.part) < preference(b.part);
      });
      const Source& first = list.front();
      for (const Source& s : list)
        WEAVE_CHECK(s.piece.shape == first.piece.shape && s.entry->dtype == first.entry->dtype,
                    kReshardOp,
                    "{}: rank {}'s part holds '{}' as {} {}, rank {}'s as {} {}: the files are "
                    "not of one checkpoint",
                    dir_, first.part->rank, global, first.entry->dtype, first.piece.shape,
                    s.part->rank, s.entry->dtype, s.piece.shape);
    }
  }

  // The saved pieces of `want`, checked against what `target` (named `local` here) needs.
  const std::vector<Source>& sources_of(const Piece& want, const Tensor& target,
                                        const std::string& local) const {
    auto found = sources_.find(want.tensor);
    WEAVE_CHECK(found != sources_.end(), kReshardOp,
                "{} holds no '{}'{}; hint: is it a checkpoint of this model (and optimizer)?", dir_,
                want.tensor,
                local == want.tensor ? "" : fmt::format(", which '{}' needs here", local));
    const Source& any = found->second.front();
    WEAVE_CHECK(any.piece.shape == want.shape, kReshardOp,
                "{} holds '{}' with shape {}, but this model's is {}; hint: is it a checkpoint "
                "of this model?",
                dir_, want.tensor, any.piece.shape, want.shape);
    WEAVE_CHECK(any.entry->dtype == target.dtype(), kReshardOp,
                "{} holds '{}' as {}, but this model's is {}; hint: convert the model to the "
                "saved dtype before loading",
                dir_, want.tensor, any.entry->dtype, target.dtype());
    return found->second;
  }

  // Plans `target`'s elements as `placement` places them.
  void fill(Tensor& target, const Pieces& pieces, const std::string& local) {
    auto* base = static_cast<char*>(target.data_ptr());
    const int64_t item = int64_t(target.itemsize());
    for (const Piece& want : pieces) {
      const std::vector<Source>& sources = sources_of(want, target, local);
      wanted_.insert(want.tensor);
      std::vector<std::vector<Run>> runs;
      for (const Source& source : sources) runs.push_back(source.runs);
      const TensorPlan tensor_plan = plan_tensor(want, runs);
      for (const ElementRead& read : tensor_plan.reads) {
        const Source& source = sources[read.source];
        const uint64_t begin = source.entry->begin + uint64_t(read.source_element * item);
        reads_[source.part->header.get()].push_back(
            {begin, begin + uint64_t(read.count * item), base + read.local * item});
        if (source.part != own_) read_elsewhere_.insert(want.tensor);
      }
      int64_t count = 0;
      for (const Run& r : tensor_plan.missing) count += r.count;
      WEAVE_CHECK(tensor_plan.missing.empty(), kReshardOp,
                  "{}: no file holds {} of the elements of '{}' that '{}' needs here (the first "
                  "missing is element {}); hint: is a shard of the checkpoint missing?",
                  dir_, count, want.tensor, local,
                  tensor_plan.missing.empty() ? 0 : tensor_plan.missing.front().global);
    }
  }

  void add(const std::string& local, const Tensor& t) {
    plan_.contents.tensors.emplace_back(local, t);
    plan_.bytes_needed += int64_t(t.numel()) * int64_t(t.itemsize());
  }

  // Reads a saved tensor whole, into a tensor of its own shape and dtype.
  void read_whole(const SavedPart& part, const data::SafetensorsEntry& entry,
                  const std::string& local) {
    Tensor t = empty(entry.shape, {.dtype = entry.dtype});
    reads_[part.header.get()].push_back({entry.begin, entry.end, t.data_ptr()});
    add(local, t);
  }

  void plan_optimizer(const std::vector<std::optional<Pieces>>& param_pieces) {
    std::set<std::string> slots;
    for (const SavedPart& part : parts_)
      for (const auto& [name, entry] : part.entries)
        if (name.rfind("optimizer/", 0) == 0 && name.rfind('.') > 10)
          slots.insert(name.substr(10, name.rfind('.') - 10));
    const std::vector<Tensor>& params = state_.optimizer->params();
    for (const std::string& slot : slots)
      for (size_t k = 0; k < params.size(); ++k) {
        const std::string local = fmt::format("optimizer/{}.{}", slot, k);
        if (!param_pieces[k]) {  // the state of a tensor outside the model: the saver's own
          if (!own_->entries.count(local)) continue;
          WEAVE_CHECK(saved_ == size_, kReshardOp,
                      "{}: '{}' is the state of a tensor outside the model, which belongs to the "
                      "rank that saved it; it loads only at the world size it was saved at ({})",
                      dir_, local, saved_);
          read_whole(*own_, *own_->entries.at(local), local);
          continue;
        }
        // The members whose state the checkpoint holds (a parameter that never had a gradient
        // has none; its elements of a flat shard stay zero, as they would have).
        Pieces present;
        for (Piece piece : *param_pieces[k]) {
          piece.tensor = "optimizer/" + slot + "/" + piece.tensor;
          if (sources_.count(piece.tensor)) present.push_back(std::move(piece));
        }
        if (present.empty()) continue;
        Tensor target = zeros(params[k].shape(),
                              {.dtype = sources_.at(present.front().tensor).front().entry->dtype});
        fill(target, present, local);
        add(local, target);
      }
  }

  // Metadata (counters, the scheduler, generators, the user's values) is this rank's own part's.
  void plan_metadata() {
    plan_.contents.metadata = own_->metadata;
    if (!state_.optimizer) return;
    auto it = plan_.contents.metadata.find("optimizer");
    json scalars =
        it == plan_.contents.metadata.end() ? json() : json::parse(it->second, nullptr, false);
    if (scalars.is_object()) {  // the count is this layout's (restore checks the rest)
      scalars["params"] = state_.optimizer->params().size();
      it->second = scalars.dump();
    }
  }

  // The loader's state is that of a saved rank with this rank's share of the data, if there is
  // one; otherwise the loader re-splits the epoch from its own part's.
  void plan_loader() {
    const auto& sampler = state_.loader->options().sampler;
    const std::pair<int, int> mine{sampler ? sampler->replicas() : 1,
                                   sampler ? sampler->replica() : 0};
    const SavedPart* from = own_;
    for (int k = 0; k < saved_; ++k)  // in order of preference
      if (const SavedPart& part = parts_[size_t((home_ + k) % saved_)]; saved_split(part) == mine) {
        from = &part;
        break;
      }
    auto loader = from->metadata.find("loader");
    if (loader != from->metadata.end()) plan_.contents.metadata["loader"] = loader->second;
    auto order = from->entries.find("loader/order");
    if (order != from->entries.end()) read_whole(*from, *order->second, "loader/order");
  }

  // Copies of the same elements saved whole by several parts must agree where this rank reads
  // another part's: replicas that trained apart, or pipeline stages that reuse names, would
  // otherwise load differently by layout.
  void check_copies_agree() const {
    for (const std::string& global : read_elsewhere_) {
      std::map<std::tuple<int, int64_t, int64_t>, const Source*> seen;
      for (const Source& s : sources_.at(global)) {
        if (!s.part->header->checked || s.piece.offset != 0 ||
            s.piece.count != s.entry->shape.numel())
          continue;
        auto [it, inserted] =
            seen.try_emplace(std::make_tuple(s.piece.axis, s.piece.begin, s.piece.first), &s);
        const Source& other = *it->second;
        WEAVE_CHECK(inserted || other.part->header->checksums.at(other.entry->name) ==
                                    s.part->header->checksums.at(s.entry->name),
                    kReshardOp,
                    "{}: rank {}'s and rank {}'s copies of '{}' differ, so what loads would "
                    "depend on the layout; hint: replicas that train apart (decentralized "
                    "training) load only at the layout they were saved at",
                    dir_, other.part->rank, s.part->rank, global);
      }
    }
  }

  const std::vector<SavedPart>& parts_;
  const data::TrainingState& state_;
  const int size_;
  const std::string& dir_;
  const int saved_, home_;
  const SavedPart* own_;
  std::map<std::string, std::vector<Source>> sources_;
  LoadPlan plan_;
  std::set<std::string> wanted_, read_elsewhere_;
  std::map<const data::SafetensorsHeader*, std::vector<data::ByteRange>> reads_;
};

}  // namespace

LoadPlan plan_load(const std::vector<SavedPart>& parts, const data::TrainingState& state, int rank,
                   int size, const std::string& dir) {
  return Planner(parts, state, rank, size, dir).run();
}

int64_t read_planned(LoadPlan& plan) {
  int64_t bytes = 0;
  for (auto& [header, ranges] : plan.reads)
    bytes += int64_t(data::read_safetensors_ranges(*header, ranges));
  return bytes;
}

}  // namespace weave::parallel::detail
