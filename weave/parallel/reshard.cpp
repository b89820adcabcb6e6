// Load-time resharding: match the pieces this rank's state needs against the pieces the saved
// parts hold, and turn the overlaps into byte ranges of the files.
#include "weave/parallel/reshard.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <tuple>

namespace weave::parallel::detail {

namespace {

using json = nlohmann::json;
constexpr const char* kOp = "load_sharded_checkpoint";
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
    WEAVE_CHECK(text != part.metadata.end(), kOp,
                "{} records no placements; hint: is it a part of a weave sharded checkpoint?",
                source);
    part.placements = parse_placements(text->second, source);
    part.metadata.erase(text);
    for (const auto& [name, placement] : part.placements) {
      auto entry = part.entries.find(name);
      WEAVE_CHECK(entry != part.entries.end(), kOp, "{} places tensor '{}', which it does not hold",
                  source, name);
      for (const Piece& piece : placement)
        WEAVE_CHECK(piece.offset + piece.count <= entry->second->shape.numel(), kOp,
                    "{}: the placement of '{}' runs past its {} elements", source, name,
                    entry->second->shape.numel());
    }
  }
  return parts;
}

std::vector<std::string> saved_globals(const std::vector<SavedPart>& parts) {
  std::set<std::string> out;
  for (const SavedPart& part : parts)
    for (const auto& [name, placement] : part.placements)
      for (const Piece& piece : placement) out.insert(piece.tensor);
  return {out.begin(), out.end()};
}

LoadPlan plan_load(const std::vector<SavedPart>& parts, const data::TrainingState& state, int rank,
                   int size, const std::string& dir) {
  const int saved = int(parts.size());
  // This rank reads from its own part first (at the saved layout it holds everything), then from
  // the next ones: ranks that need the same replica read it from different files.
  const int home = rank % saved;
  const SavedPart* own = &parts[size_t(home)];
  auto preference = [&](const SavedPart* part) { return (part->rank - home + saved) % saved; };

  // Every global tensor's saved pieces, in this rank's order of preference.
  std::map<std::string, std::vector<Source>> sources;
  for (const SavedPart& part : parts)
    for (const auto& [name, placement] : part.placements)
      for (const Piece& piece : placement)
        sources[piece.tensor].push_back({&part, part.entries.at(name), piece, runs_of(piece)});
  for (auto& [global, list] : sources)
    std::stable_sort(list.begin(), list.end(), [&](const Source& a, const Source& b) {
      return preference(a.part) < preference(b.part);
    });
  for (const auto& [global, list] : sources)
    for (const Source& s : list) {
      const Source& first = list.front();
      WEAVE_CHECK(s.piece.shape == first.piece.shape && s.entry->dtype == first.entry->dtype, kOp,
                  "{}: rank {}'s part holds '{}' as {} {}, rank {}'s as {} {}: the files are not "
                  "of one checkpoint",
                  dir, first.part->rank, global, first.entry->dtype, first.piece.shape,
                  s.part->rank, s.entry->dtype, s.piece.shape);
    }

  LoadPlan plan;
  std::set<std::string> wanted, read_elsewhere;
  std::map<const data::SafetensorsHeader*, std::vector<data::ByteRange>> reads;
  // Plans `target`'s elements as `placement` places them.
  auto fill = [&](Tensor& target, const Placement& placement, const std::string& local) {
    auto* base = static_cast<char*>(target.data_ptr());
    const int64_t item = int64_t(target.itemsize());
    for (const Piece& want : placement) {
      auto found = sources.find(want.tensor);
      WEAVE_CHECK(found != sources.end(), kOp,
                  "{} holds no '{}'{}; hint: is it a checkpoint of this model (and optimizer)?",
                  dir, want.tensor,
                  local == want.tensor ? "" : fmt::format(", which '{}' needs here", local));
      const Source& any = found->second.front();
      WEAVE_CHECK(any.piece.shape == want.shape, kOp,
                  "{} holds '{}' with shape {}, but this model's is {}; hint: is it a checkpoint "
                  "of this model?",
                  dir, want.tensor, any.piece.shape, want.shape);
      WEAVE_CHECK(any.entry->dtype == target.dtype(), kOp,
                  "{} holds '{}' as {}, but this model's is {}; hint: convert the model to the "
                  "saved dtype before loading",
                  dir, want.tensor, any.entry->dtype, target.dtype());
      wanted.insert(want.tensor);
      std::vector<Run> missing = runs_of(want);
      for (const Source& source : found->second) {
        if (missing.empty()) break;
        const std::vector<Run>& have = source.runs;
        std::vector<Run> still;
        for (const Run& need : missing) {
          int64_t at = need.global;
          const int64_t end = need.global + need.count;
          auto it = std::upper_bound(have.begin(), have.end(), at, [](int64_t g, const Run& r) {
            return g < r.global + r.count;
          });
          for (; it != have.end() && it->global < end; ++it) {
            const int64_t from = std::max(at, it->global),
                          to = std::min(end, it->global + it->count);
            if (from > at) still.push_back({at, from - at, need.local + (at - need.global)});
            const uint64_t begin =
                source.entry->begin + uint64_t((it->local + from - it->global) * item);
            reads[source.part->header.get()].push_back(
                {begin, begin + uint64_t((to - from) * item),
                 base + (need.local + from - need.global) * item});
            if (source.part != own) read_elsewhere.insert(want.tensor);
            at = to;
          }
          if (at < end) still.push_back({at, end - at, need.local + (at - need.global)});
        }
        missing = std::move(still);
      }
      int64_t count = 0;
      for (const Run& r : missing) count += r.count;
      WEAVE_CHECK(missing.empty(), kOp,
                  "{}: no file holds {} of the elements of '{}' that '{}' needs here (the first "
                  "missing is element {}); hint: is a shard of the checkpoint missing?",
                  dir, count, want.tensor, local, missing.empty() ? 0 : missing.front().global);
    }
  };
  auto add = [&](const std::string& local, const Tensor& t) {
    plan.contents.tensors.emplace_back(local, t);
    plan.bytes_needed += int64_t(t.numel()) * int64_t(t.itemsize());
  };
  // A tensor that belongs to the rank that saved it: read whole from this rank's own part.
  auto read_own = [&](const std::string& local) {
    const data::SafetensorsEntry* entry = own->entries.at(local);
    Tensor t = empty(entry->shape, {.dtype = entry->dtype});
    reads[own->header.get()].push_back({entry->begin, entry->end, t.data_ptr()});
    add(local, t);
  };

  const StatePlacements placements = describe_state(state);
  if (state.model)
    for (const auto& [name, t] : state.model->state_dict()) {
      Tensor target = zeros(t.shape(), {.dtype = t.dtype()});  // a flat shard's padding stays 0
      fill(target, placements.model.at("model/" + name), "model/" + name);
      add("model/" + name, target);
    }
  if (state.optimizer) {
    std::set<std::string> slots;
    for (const SavedPart& part : parts)
      for (const auto& [name, entry] : part.entries)
        if (name.rfind("optimizer/", 0) == 0 && name.rfind('.') > 10)
          slots.insert(name.substr(10, name.rfind('.') - 10));
    const std::vector<Tensor>& params = state.optimizer->params();
    const auto& param_placements = placements.params;
    for (const std::string& slot : slots)
      for (size_t k = 0; k < params.size(); ++k) {
        const std::string local = fmt::format("optimizer/{}.{}", slot, k);
        if (!param_placements[k]) {
          if (!own->entries.count(local)) continue;
          WEAVE_CHECK(saved == size, kOp,
                      "{}: '{}' is the state of a tensor outside the model, which belongs to the "
                      "rank that saved it; it loads only at the world size it was saved at ({})",
                      dir, local, saved);
          read_own(local);
          continue;
        }
        // The members whose state the checkpoint holds (a parameter that never had a gradient
        // has none; its elements of a flat shard stay zero, as they would have).
        Placement present;
        for (Piece piece : *param_placements[k]) {
          piece.tensor = "optimizer/" + slot + "/" + piece.tensor;
          if (sources.count(piece.tensor)) present.push_back(std::move(piece));
        }
        if (present.empty()) continue;
        Tensor target = zeros(params[k].shape(),
                              {.dtype = sources.at(present.front().tensor).front().entry->dtype});
        fill(target, present, local);
        add(local, target);
      }
  }

  // Metadata (counters, the scheduler, generators, the user's values) is this rank's own part's.
  plan.contents.metadata = own->metadata;
  if (state.optimizer) {
    auto it = plan.contents.metadata.find("optimizer");
    json scalars =
        it == plan.contents.metadata.end() ? json() : json::parse(it->second, nullptr, false);
    if (scalars.is_object()) {  // the count is this layout's (restore checks the rest)
      scalars["params"] = state.optimizer->params().size();
      it->second = scalars.dump();
    }
  }
  // The loader's state is that of a saved rank with this rank's share of the data, if there is
  // one; otherwise the loader re-splits the epoch from its own part's.
  if (state.loader) {
    const auto& sampler = state.loader->options().sampler;
    const std::pair<int, int> mine{sampler ? sampler->replicas() : 1,
                                   sampler ? sampler->replica() : 0};
    const SavedPart* from = own;
    for (int k = 0; k < saved; ++k)  // in order of preference
      if (const SavedPart& part = parts[size_t((home + k) % saved)]; saved_split(part) == mine) {
        from = &part;
        break;
      }
    auto loader = from->metadata.find("loader");
    if (loader != from->metadata.end()) plan.contents.metadata["loader"] = loader->second;
    auto order = from->entries.find("loader/order");
    if (order != from->entries.end()) {
      Tensor t = empty(order->second->shape, {.dtype = order->second->dtype});
      reads[from->header.get()].push_back({order->second->begin, order->second->end, t.data_ptr()});
      add("loader/order", t);
    }
  }

  // Copies of the same elements saved whole by several parts must agree where this rank reads
  // another part's: replicas that trained apart, or pipeline stages that reuse names, would
  // otherwise load differently by layout.
  for (const std::string& global : read_elsewhere) {
    std::map<std::tuple<int, int64_t, int64_t>, const Source*> seen;
    for (const Source& s : sources.at(global)) {
      if (!s.part->header->checked || s.piece.offset != 0 ||
          s.piece.count != s.entry->shape.numel())
        continue;
      auto [it, inserted] =
          seen.try_emplace(std::make_tuple(s.piece.axis, s.piece.begin, s.piece.first), &s);
      const Source& other = *it->second;
      WEAVE_CHECK(inserted || other.part->header->checksums.at(other.entry->name) ==
                                  s.part->header->checksums.at(s.entry->name),
                  kOp,
                  "{}: rank {}'s and rank {}'s copies of '{}' differ, so what loads would depend "
                  "on the layout; hint: replicas that train apart (decentralized training) load "
                  "only at the layout they were saved at",
                  dir, other.part->rank, s.part->rank, global);
    }
  }
  plan.wanted.assign(wanted.begin(), wanted.end());
  for (auto& [header, ranges] : reads) plan.reads.emplace_back(header, std::move(ranges));
  return plan;
}

int64_t read_planned(LoadPlan& plan) {
  int64_t bytes = 0;
  for (auto& [header, ranges] : plan.reads)
    bytes += int64_t(data::read_safetensors_ranges(*header, ranges));
  return bytes;
}

}  // namespace weave::parallel::detail
