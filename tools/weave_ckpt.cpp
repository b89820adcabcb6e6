// weave-ckpt: inspect a sharded checkpoint directory.
//
//   weave-ckpt info DIR     generations, world size, layout, every global tensor with its shape
//                           and how the ranks hold it, counters; then every file read whole and
//                           its checksums verified (exit status 1 on the first mismatch). It
//                           checks the index as the loader does: "ok" means it loads.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <system_error>

#include "weave/parallel/checkpoint/checkpoint_index.h"
#include "weave/parallel/checkpoint/reshard.h"

namespace {

using namespace weave;
using json = nlohmann::json;
namespace fs = std::filesystem;
using parallel::detail::Piece;
using parallel::detail::SavedPart;

struct Holding {
  std::set<int> ranks;
  std::set<std::pair<int64_t, int64_t>> boxes;  // tensor-parallel pieces
  int axis = -1;
  bool flat = false;  // in slices of flattened parameters (ZeRO-1, FSDP)
};

Holding holding_of(const std::vector<std::pair<int, Piece>>& pieces) {
  Holding h;
  for (const auto& [rank, piece] : pieces) {
    h.ranks.insert(rank);
    h.boxes.insert({piece.begin, piece.length});
    h.axis = piece.axis;
    const int64_t box = piece.axis < 0
                            ? piece.shape.numel()
                            : piece.shape.numel() / piece.shape[piece.axis] * piece.length;
    h.flat = h.flat || piece.count != box;
  }
  return h;
}

// How the saved parts hold one global tensor, in words.
std::string describe(const Holding& h) {
  std::string out = h.axis >= 0 ? fmt::format("split along axis {} in {}", h.axis, h.boxes.size())
                                : std::string("not split");
  const size_t ranks = h.ranks.size();
  if (h.flat)
    out += fmt::format(", flat slices (ZeRO-1 / FSDP) on {} rank{}", ranks, ranks == 1 ? "" : "s");
  else if (ranks == h.boxes.size())
    out += fmt::format(", on {} rank{}", ranks, ranks == 1 ? "" : "s");
  else
    out += fmt::format(", {} copies on {} ranks", ranks / h.boxes.size(), ranks);
  return out;
}

std::string megabytes(int64_t bytes) {
  return bytes < 100000 ? fmt::format("{:.1f} kB", double(bytes) / 1e3)
                        : fmt::format("{:.1f} MB", double(bytes) / 1e6);
}

int info(const std::string& dir) {
  // The loader's own checks: what passes here loads.
  const parallel::detail::CheckpointIndex index = parallel::detail::read_checkpoint_index(dir);
  const int world = index.world_size;
  const bool single = index.single_file;
  std::printf("checkpoint %s\n", dir.c_str());
  std::printf("  format %s, generation %lld (the newest complete), saved by %d ranks, %s\n",
              index.format.c_str(), static_cast<long long>(index.generation), world,
              single ? "one file" : "a file per rank");
  if (!index.save_id.empty()) std::printf("  save id %s\n", index.save_id.c_str());
  // Generations still on disk: the committed one, and any a killed save left behind.
  std::set<long long> generations;
  std::error_code listing;
  for (const auto& entry : fs::directory_iterator(dir, listing)) {
    const int64_t g = parallel::detail::generation_of(entry.path().filename().string());
    if (g >= 0) generations.insert(g);
  }
  std::printf("  generations on disk:");
  for (long long g : generations) std::printf(" %lld", g);
  std::printf("\n");

  const auto headers = parallel::detail::read_checkpoint_headers(dir, index);
  int64_t bytes = 0;
  for (const std::string& name : index.files) {
    std::error_code ec;
    const auto size = fs::file_size(dir + "/" + name, ec);
    bytes += ec ? 0 : int64_t(size);
  }
  std::printf("  files: %zu, %s\n", headers.size(), megabytes(bytes).c_str());
  if (!index.has_placements()) {
    std::printf("  (format 1 records no placements: it loads at %d ranks only)\n", world);
  } else {
    const std::vector<SavedPart> parts = parallel::detail::saved_parts(headers, single, world);
    std::map<std::string, std::vector<std::pair<int, Piece>>> globals;
    std::map<std::string, DType> dtypes;
    for (const SavedPart& part : parts)
      for (const auto& [name, pieces] : part.pieces)
        for (const Piece& piece : pieces) {
          globals[piece.tensor].push_back({part.rank, piece});
          dtypes[piece.tensor] = part.entries.at(name)->dtype;
        }
    size_t tensor_parallel = 1;
    bool model_flat = false, optimizer_flat = false;
    for (const auto& [name, pieces] : globals) {
      const Holding h = holding_of(pieces);
      tensor_parallel = std::max(tensor_parallel, h.boxes.size());
      (name.rfind("model/", 0) == 0 ? model_flat : optimizer_flat) |= h.flat;
    }
    std::printf("  layout: tensor-parallel pieces: %zu; parameters: %s; optimizer state: %s\n",
                tensor_parallel, model_flat ? "flat-sharded (FSDP)" : "whole on each rank",
                optimizer_flat ? "flat-sharded (ZeRO-1 / FSDP)" : "whole on each rank");
    std::printf("  tensors (%zu):\n", globals.size());
    for (const auto& [name, pieces] : globals)
      std::printf("    %-40s %-8s %-14s %s\n", name.c_str(), dtype_name(dtypes[name]),
                  pieces.front().second.shape.str().c_str(), describe(holding_of(pieces)).c_str());
    const data::Metadata& meta = parts.front().metadata;
    for (const char* key : {"optimizer", "scheduler.step"}) {
      auto it = meta.find(key);
      if (it != meta.end()) std::printf("  %s (rank 0): %s\n", key, it->second.c_str());
    }
    auto loader = meta.find("loader");
    if (loader != meta.end()) {
      json state = json::parse(loader->second, nullptr, false);
      if (state.is_object()) state.erase("generator");  // the shuffle generator: 5 kB of digits
      std::printf("  loader (rank 0): %s\n", state.dump().c_str());
    }
    for (const auto& [key, value] : meta)
      if (key.rfind("user.", 0) == 0)
        std::printf("  %s (rank 0): %s\n", key.c_str(), value.c_str());
  }
  // Every file read whole: its CRC-32 against the index, its save id, each tensor's checksum.
  parallel::detail::verify_checkpoint_files(dir, index);
  std::printf("  checksums: ok (%s every tensor of %zu file%s)\n",
              index.checksums.empty() ? "" : "each file whole and", headers.size(),
              headers.size() == 1 ? "" : "s");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("Inspects a sharded checkpoint with the loader's own checks.", "weave-ckpt");
  std::string dir;
  CLI::App* describe = app.add_subcommand(
      "info",
      "the generations on disk, the layout, every global tensor, the counters and the loader's "
      "position; every file read whole against its checksums (exit 1 on a mismatch)");
  describe->add_option("dir", dir, "the checkpoint directory")->required();
  app.require_subcommand(1);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }
  try {
    return info(dir);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "weave-ckpt: %s\n", e.what());
    return 1;
  }
}
