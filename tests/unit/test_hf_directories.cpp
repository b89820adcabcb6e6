// Hugging Face directories as users find them, against the reference checkpoints
// (tests/data/hf): files named outside the directory (an index entry with "..", an absolute
// path, a link out of it, a FIFO) raise and a Hugging Face cache snapshot's links into its
// blobs load; an export over an earlier one leaves only the new export's model files (both
// orders of single-file and sharded, the other files kept, a dropped export changing nothing);
// an export sweeps the staging folders killed exports left (not a live writer's, not a link);
// a config that does not account for the weights, two exports' entry files side by side, and
// non-finite weights raise, naming what.
#include <sys/stat.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "helpers.h"
#include "hf_helpers.h"
#include "weave/data/staged_directory.h"

using namespace weave;
using namespace weave_test;

namespace {

// The models' parameters, name by name, bit for bit (NaNs included).
bool same_weights(nn::Module& a, nn::Module& b) {
  const auto x = a.named_parameters(), y = b.named_parameters();
  if (x.size() != y.size()) return false;
  for (size_t i = 0; i < x.size(); ++i) {
    const Tensor p = x[i].second.contiguous(), q = y[i].second.contiguous();
    if (x[i].first != y[i].first || p.dtype() != q.dtype() || p.shape() != q.shape() ||
        std::memcmp(p.data_ptr(), q.data_ptr(), size_t(p.numel()) * itemsize(p.dtype())) != 0)
      return false;
  }
  return true;
}

// The names in a directory.
std::set<std::string> entries(const fs::path& dir) {
  std::set<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.insert(entry.path().filename());
  return names;
}

// The reference GPT-2 with every parameter scaled: another model of the same config.
std::shared_ptr<nn::CausalLM> scaled_gpt2(double factor) {
  auto model = models::from_pretrained(reference_dir("gpt2"));
  NoGradGuard no_grad;
  for (auto& [name, p] : model->named_parameters()) p.mul_(factor);
  return model;
}

void rewrite_index(const fs::path& dir, const std::string& tensor, const std::string& file) {
  auto index = nlohmann::json::parse(std::ifstream(dir / "model.safetensors.index.json"));
  index["weight_map"][tensor] = file;
  std::ofstream(dir / "model.safetensors.index.json") << index.dump();
}

}  // namespace

TEST_SUITE("hf_checkpoint") {
  TEST_CASE("a checkpoint's files stay in its directory; a cache snapshot's blob links load") {
    const std::string shard = "model-00002-of-00002.safetensors";
    const std::string moved = "transformer.h.0.attn.c_attn.bias";  // in shard 2
    const auto planted = [&](const std::string& name) {
      const auto dir = scratch(name) / "model";
      copy_checkpoint(reference_dir("gpt2"), dir);
      fs::copy_file(dir / shard, dir.parent_path() / "outside.safetensors");
      return dir;
    };
    auto dir = planted("dotdot");
    rewrite_index(dir, moved, "../outside.safetensors");
    CHECK_THROWS_WITH_AS(models::from_pretrained(dir.string()),
                         doctest::Contains("names '../outside.safetensors', a path outside the "
                                           "directory"),
                         Error);
    dir = planted("absolute");
    rewrite_index(dir, moved, (dir.parent_path() / "outside.safetensors").string());
    CHECK_THROWS_WITH_AS(models::from_pretrained(dir.string()),
                         doctest::Contains("a path outside the directory"), Error);
    dir = planted("link_out");
    fs::remove(dir / shard);
    fs::create_symlink(dir.parent_path() / "outside.safetensors", dir / shard);
    CHECK_THROWS_WITH_AS(models::from_pretrained(dir.string()),
                         doctest::Contains(("names '" + shard + "', which leads to").c_str()),
                         Error);
    dir = planted("fifo");  // a FIFO would block the read forever
    fs::remove(dir / shard);
    REQUIRE(::mkfifo((dir / shard).c_str(), 0600) == 0);
    CHECK_THROWS_WITH_AS(models::from_pretrained(dir.string()),
                         doctest::Contains("which is no regular file"), Error);

    // Hugging Face's cache: snapshots/<revision>/<file> -> ../../blobs/<hash>.
    const auto cache = scratch("hub") / "models--tiny--gpt2";
    fs::create_directories(cache / "blobs");
    const auto snapshot = cache / "snapshots" / "0123abcd";
    fs::create_directories(snapshot);
    int blob = 0;
    for (const auto& entry : fs::directory_iterator(reference_dir("gpt2"))) {
      const std::string hash = "blob" + std::to_string(blob++);
      fs::copy_file(entry.path(), cache / "blobs" / hash);
      fs::create_symlink(fs::path("../../blobs") / hash, snapshot / entry.path().filename());
    }
    auto cached = models::from_pretrained(snapshot.string());
    auto original = models::from_pretrained(reference_dir("gpt2"));
    CHECK(same_weights(*cached, *original));
  }

  TEST_CASE("an export replaces the directory's model files as one unit") {
    const auto config = data::hf::read_config(reference_dir("gpt2"));
    auto first = scaled_gpt2(1.0), second = scaled_gpt2(0.5);
    uint64_t bytes = 0;
    for (const auto& [name, p] : first->named_parameters()) bytes += uint64_t(p.numel()) * 4;
    struct Export {
      const char* label;
      uint64_t shard_bytes;  // 0: one file
    };
    const Export single{"single", 0}, six{"6 shards", bytes / 6}, three{"3 shards", bytes / 3};
    for (const auto& order : {std::pair{single, six}, std::pair{six, three},
                              std::pair{three, single}, std::pair{six, single}}) {
      const Export &before = order.first, &after = order.second;
      CAPTURE(before.label);
      CAPTURE(after.label);
      const auto dir = scratch("orders") / "model";
      const auto save = [&](nn::Module& model, const Export& e) {
        data::hf::save_pretrained(model, config, dir.string(),
                                  {.max_shard_bytes = e.shard_bytes ? e.shard_bytes : bytes * 2});
      };
      save(*first, before);
      std::ofstream(dir / "README.md") << "kept";
      fs::create_directories(dir / "notes");
      std::ofstream(dir / "notes" / "a.txt") << "kept too";
      save(*second, after);
      std::set<std::string> expected{"config.json", "generation_config.json", "README.md", "notes"};
      if (after.shard_bytes == 0) {
        expected.insert("model.safetensors");
      } else {
        auto index = nlohmann::json::parse(std::ifstream(dir / "model.safetensors.index.json"));
        for (const auto& [tensor, file] : index["weight_map"].items()) expected.insert(file);
        expected.insert("model.safetensors.index.json");
        CHECK(expected.size() > 5);  // sharded indeed
      }
      CHECK(entries(dir) == expected);
      CHECK(entries(dir.parent_path()) == std::set<std::string>{"model"});  // no staging left
      auto loaded = models::from_pretrained(dir.string());
      CHECK(same_weights(*loaded, *second));
    }
    // An export dropped before finish() changes nothing.
    const auto dir = scratch("dropped") / "model";
    data::hf::save_pretrained(*first, config, dir.string());
    const auto kept = entries(dir);
    {
      data::hf::PretrainedWriter out(config, dir.string());
      out.write(out.names()[0], second->named_parameters()[0].second);
    }
    CHECK(entries(dir) == kept);
    CHECK(entries(dir.parent_path()) == std::set<std::string>{"model"});
    auto loaded = models::from_pretrained(dir.string());
    CHECK(same_weights(*loaded, *first));
  }

  TEST_CASE("an export sweeps what killed exports left beside the directory, not a live one's") {
    const auto config = data::hf::read_config(reference_dir("gpt2"));
    auto first = scaled_gpt2(1.0), second = scaled_gpt2(0.5);
    const auto dir = scratch("sweep") / "model", parent = dir.parent_path();
    data::hf::save_pretrained(*first, config, dir.string());
    // A killed export's staging folder (no process holds it) and a link named like one.
    fs::create_directories(parent / ".model.staged-00000000dead0001" / "sub");
    std::ofstream(parent / ".model.staged-00000000dead0001" / "sub" / "part") << "partial";
    const auto victim = scratch("sweep-victim");
    fs::create_directories(victim);
    std::ofstream(victim / "precious") << "kept";
    fs::create_directory_symlink(victim, parent / ".model.staged-link");
    // A writer alive in this process: its folder is locked, and stays.
    std::optional<data::StagedDirectory> live;
    live.emplace(dir.string(), [](const std::string&) { return false; });
    const std::string live_name = fs::path(live->path()).filename();
    data::hf::save_pretrained(*second, config, dir.string());
    CHECK(entries(parent) == std::set<std::string>{"model", live_name, ".model.staged-link"});
    CHECK(std::ifstream(victim / "precious").good());
    CHECK(same_weights(*models::from_pretrained(dir.string()), *second));
    live.reset();  // dropped without commit(): it removes its folder itself
    CHECK(entries(parent) == std::set<std::string>{"model", ".model.staged-link"});
  }

  TEST_CASE("tensors the config does not account for, and two exports' entry files, raise") {
    const auto dir = scratch("fewer_layers");
    copy_checkpoint(reference_dir("gpt2"), dir);
    edit_config(dir, [](auto& c) { c["n_layer"] = 1; });
    CHECK_THROWS_WITH_AS(models::from_pretrained(dir.string()),
                         doctest::Contains("holds 12 tensor(s) the config's model does not use: "
                                           "transformer.h.1."),
                         Error);
    const auto config = data::hf::read_config(dir.string());
    std::shared_ptr<nn::CausalLM> model;
    {
      nn::DeferredInit deferred(0);
      model = models::make_model(config);
    }
    const data::hf::LoadStats stats =
        data::hf::load_weights(*model, config, dir.string(), {.allow_unused = true});
    CHECK(stats.unused.size() == 12);
    CHECK(stats.unused[0].starts_with("transformer.h.1."));

    const auto both = scratch("both");
    copy_checkpoint(reference_dir("gpt2"), both);
    fs::copy_file(both / "model-00001-of-00002.safetensors", both / "model.safetensors");
    CHECK_THROWS_WITH_AS(models::from_pretrained(both.string()),
                         doctest::Contains("holds both model.safetensors and "
                                           "model.safetensors.index.json"),
                         Error);
  }

  TEST_CASE("non-finite weights raise at load, naming the tensor and the first index") {
    const auto config = data::hf::read_config(reference_dir("gpt2"));
    for (const double bad : {std::nan(""), -HUGE_VAL}) {
      auto model = scaled_gpt2(1.0);
      {
        NoGradGuard no_grad;
        dynamic_cast<models::GPT2&>(*model).positions->weight.select(0, 3).narrow(0, 5, 2).fill_(
            bad);
      }
      const auto dir = scratch("non_finite");
      data::hf::save_pretrained(*model, config, dir.string());
      CHECK_THROWS_WITH_AS(models::from_pretrained(dir.string()),
                           doctest::Contains("positions.weight (transformer.wpe.weight in"), Error);
      CHECK_THROWS_WITH_AS(models::from_pretrained(dir.string()),
                           doctest::Contains(fmt::format("holds {} at [3, 5]", bad).c_str()),
                           Error);
      auto loaded = models::from_pretrained(dir.string(), {}, {}, {.check_finite = false});
      CHECK(same_weights(*loaded, *model));
    }
  }
}
