// Hugging Face checkpoints against PyTorch: bench/pretrained/hf_reference.py wrote a tiny GPT-2
// and a tiny Llama (4 query and 2 key/value heads, rotary with Llama 3's scaling, SwiGLU,
// RMSNorm) in Hugging Face's layout, two shards with an index each, and their logits on fixed
// tokens (tests/data/hf). Generation with the key/value caches against full forward passes.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "helpers.h"

using namespace weave;
namespace fs = std::filesystem;

namespace {

std::string reference_dir(const std::string& arch) {
  return std::string(WEAVE_TEST_DATA_DIR) + "/hf/" + arch;
}

fs::path scratch(const std::string& name) {
  const auto dir = fs::temp_directory_path() / ("weave_hf_" + std::to_string(::getpid())) / name;
  fs::remove_all(dir);
  fs::create_directories(dir.parent_path());
  return dir;
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  return max(abs(a.to(kFloat64) - b.to(kFloat64))).item<double>();
}

// The shape and dtype of every tensor of a checkpoint directory, by name.
std::map<std::string, std::pair<Shape, DType>> layout_of(const std::string& dir) {
  std::map<std::string, std::pair<Shape, DType>> out;
  for (const auto& entry : fs::directory_iterator(dir))
    if (entry.path().extension() == ".safetensors" &&
        entry.path().filename() != "logits.safetensors")
      for (const auto& e : data::read_safetensors_header(entry.path().string()).entries)
        out[e.name] = {e.shape, e.dtype};
  return out;
}

// A module holding given tensors under given dotted names (children made as the names need).
class Holder : public nn::Module {
 public:
  Holder() : Module("Holder") {}
  void add(const std::string& name, const Tensor& value) {
    const size_t dot = name.find('.');
    if (dot == std::string::npos) {
      register_parameter(name, value);
      return;
    }
    auto& child = children_[name.substr(0, dot)];
    if (!child) child = register_module(name.substr(0, dot), std::make_shared<Holder>());
    child->add(name.substr(dot + 1), value);
  }

 private:
  std::map<std::string, std::shared_ptr<Holder>> children_;
};

void copy_checkpoint(const std::string& from, const fs::path& to) {
  fs::create_directories(to);
  for (const auto& entry : fs::directory_iterator(from))
    fs::copy_file(entry.path(), to / entry.path().filename());
}

void edit_config(const fs::path& dir, const std::function<void(nlohmann::json&)>& edit) {
  auto config = nlohmann::json::parse(std::ifstream(dir / "config.json"));
  edit(config);
  std::ofstream(dir / "config.json") << config.dump();
}

}  // namespace

TEST_SUITE("hf_checkpoint") {
  TEST_CASE("GPT-2 and Llama checkpoints give PyTorch's logits; export reloads bitwise") {
    for (const std::string arch : {"gpt2", "llama"}) {
      CAPTURE(arch);
      const std::string dir = reference_dir(arch);
      auto model = data::hf::from_pretrained(dir);
      const auto expected = data::load_safetensors(dir + "/logits.safetensors").tensors;
      const Tensor tokens = expected[1].first == "tokens" ? expected[1].second : expected[0].second;
      const Tensor logits = expected[0].first == "logits" ? expected[0].second : expected[1].second;
      NoGradGuard no_grad;
      model->eval();
      CHECK(max_abs_diff((*model)(tokens), logits) < 1e-5);

      const auto config = data::hf::read_config(dir);
      const auto out = scratch(arch + "_export");
      data::hf::save_pretrained(*model, config, out.string(), {.max_shard_bytes = 300000});
      CHECK(fs::exists(out / "model.safetensors.index.json"));
      CHECK(layout_of(out.string()) == layout_of(dir));
      auto reloaded = data::hf::from_pretrained(out.string());
      const auto before = model->named_parameters(), after = reloaded->named_parameters();
      REQUIRE(before.size() == after.size());
      for (size_t i = 0; i < before.size(); ++i) {
        CAPTURE(before[i].first);
        CHECK(before[i].first == after[i].first);
        CHECK(max_abs_diff(before[i].second, after[i].second) == 0);
      }
    }
  }

  TEST_CASE("GPT-2's fused q/k/v read by heads equals the whole split by heads") {
    const std::string dir = reference_dir("gpt2");
    const auto config = data::hf::read_config(dir);
    auto whole = data::hf::from_pretrained(dir);
    Holder part;
    std::map<std::string, data::hf::Slice> slices;
    for (auto& [name, p] : whole->named_parameters()) {
      if (name.find("attention.qkv") == std::string::npos) continue;
      slices[name] = {0, p.size(0) / 4, p.size(0) / 2};  // the second of 4 heads
      part.add(name, zeros_like(p.narrow(0, p.size(0) / 4, p.size(0) / 4)));
    }
    data::hf::load_weights(part, config, dir,
                           [&](const std::string& name, const Tensor&) { return slices[name]; });
    for (auto& [name, p] : part.named_parameters())
      for (auto& [whole_name, w] : whole->named_parameters())
        if (whole_name == name)
          CHECK(max_abs_diff(p, w.narrow(0, w.size(0) / 4, w.size(0) / 4)) == 0);
  }

  TEST_CASE("a split model's parameters read only their slices") {
    const std::string dir = reference_dir("llama");
    const auto config = data::hf::read_config(dir);
    auto whole = data::hf::from_pretrained(dir);
    // Every tensor's second half along one axis (a rank's piece: rows, or columns for the
    // row-parallel out and down projections, key/value heads for the stacked kv), in a module
    // with the whole model's names.
    std::map<std::string, data::hf::Slice> slices;
    Holder part;
    for (auto& [name, p] : whole->named_parameters()) {
      const int axis = p.dim() == 3                                                    ? 1
                       : name.ends_with("out.weight") || name.ends_with("down.weight") ? 1
                                                                                       : 0;
      slices[name] = {axis, p.size(axis) / 2, p.size(axis)};
      part.add(name, zeros_like(p.narrow(axis, 0, p.size(axis) / 2)));
    }
    const auto stats = data::hf::load_weights(
        part, config, dir, [&](const std::string& name, const Tensor&) { return slices[name]; });
    const auto mine = part.named_parameters(), theirs = whole->named_parameters();
    int64_t elements = 0;
    for (size_t i = 0; i < mine.size(); ++i) {
      const auto& s = slices[theirs[i].first];
      CHECK(max_abs_diff(mine[i].second,
                         theirs[i].second.narrow(s.axis, s.begin, s.end - s.begin)) == 0);
      elements += mine[i].second.numel();
    }
    CHECK(stats.bytes_read == elements * 4);  // float32: half of every tensor, nothing more
  }

  TEST_CASE("bad checkpoints raise, naming what is wrong") {
    const auto broken = [](const std::string& name) {
      const auto dir = scratch(name);
      copy_checkpoint(reference_dir("llama"), dir);
      return dir;
    };
    auto dir = broken("missing_shard");
    fs::remove(dir / "model-00002-of-00002.safetensors");
    CHECK_THROWS_WITH_AS(data::hf::from_pretrained(dir.string()),
                         doctest::Contains("model-00002-of-00002.safetensors (holding"), Error);
    dir = broken("wrong_shape");
    edit_config(dir, [](auto& c) { c["intermediate_size"] = 160; });
    CHECK_THROWS_WITH_AS(data::hf::from_pretrained(dir.string()),
                         doctest::Contains("has shape [176, 64], but the config's model needs "
                                           "[160, 64]"),
                         Error);
    dir = broken("unknown");
    edit_config(dir, [](auto& c) { c["model_type"] = "bert"; });
    CHECK_THROWS_WITH_AS(data::hf::from_pretrained(dir.string()),
                         doctest::Contains("unknown architecture: model_type 'bert'"), Error);
    dir = broken("bias");
    edit_config(dir, [](auto& c) { c["attention_bias"] = true; });
    CHECK_THROWS_WITH_AS(data::hf::from_pretrained(dir.string()),
                         doctest::Contains("attention_bias true is not supported"), Error);
    dir = broken("untied");
    edit_config(dir, [](auto& c) { c["tie_word_embeddings"] = true; });  // lm_head unused
    auto tied = data::hf::from_pretrained(dir.string());
    CHECK(dynamic_cast<nn::LlamaModel&>(*tied).head == nullptr);
  }

  TEST_CASE("greedy decoding with the caches equals the argmax of full forward passes") {
    for (const std::string arch : {"gpt2", "llama"}) {
      CAPTURE(arch);
      auto model = data::hf::from_pretrained(reference_dir(arch));
      const Tensor prompt =
          from_vector(std::vector<int64_t>{5, 17, 300, 42, 7, 99, 1, 2, 3, 4}, {2, 5});
      const Tensor generated = nn::generate(*model, prompt, {.max_new_tokens = 64});
      REQUIRE(generated.shape() == Shape{2, 69});
      NoGradGuard no_grad;
      Tensor sequence = prompt;
      for (int64_t step = 0; step < 64; ++step) {
        const Tensor logits = (*model)(sequence);
        const Tensor next = argmax(logits.select(1, logits.size(1) - 1), -1).reshape({2, 1});
        sequence = cat({sequence, next}, 1);
      }
      CHECK(max_abs_diff(generated, sequence) == 0);
    }
  }

  TEST_CASE("generation stops each row at end-of-text, and ends when every row has") {
    auto model = data::hf::from_pretrained(reference_dir("llama"));
    const Tensor prompt =
        from_vector(std::vector<int64_t>{5, 17, 300, 42, 7, 99, 1, 2, 3, 4}, {2, 5});
    const Tensor free = nn::generate(*model, prompt, {.max_new_tokens = 12});
    // Row 0's fourth new token as the end-of-text id: row 0 stops there.
    const int64_t stop = free.select(0, 0).select(0, 5 + 3).item<int64_t>();
    const Tensor stopped =
        nn::generate(*model, prompt, {.max_new_tokens = 12, .end_of_text = stop});
    for (int64_t row = 0; row < 2; ++row) {
      bool seen = false;
      for (int64_t i = 5; i < stopped.size(1); ++i) {
        const int64_t got = stopped.select(0, row).select(0, i).item<int64_t>();
        if (seen)
          CHECK(got == stop);  // after its end-of-text a row repeats it
        else
          CHECK(got == free.select(0, row).select(0, i).item<int64_t>());
        seen = seen || got == stop;
      }
      if (row == 0) CHECK(seen);
    }
    // Two rows that stop at their first new token: generation ends there.
    const Tensor twice = from_vector(std::vector<int64_t>{5, 17, 300, 5, 17, 300}, {2, 3});
    const int64_t first = nn::generate(*model, twice, {.max_new_tokens = 1})
                              .select(1, 3)
                              .select(0, 0)
                              .item<int64_t>();
    const Tensor early = nn::generate(*model, twice, {.max_new_tokens = 12, .end_of_text = first});
    CHECK(early.shape() == Shape{2, 4});
  }

  TEST_CASE("sampling: top-k, top-p and temperature draw from the right distribution") {
    // probabilities 0.4, 0.3, 0.2, 0.1 (ids 2, 0, 3, 1)
    const Tensor logits = from_vector(
        std::vector<float>{std::log(0.3f), std::log(0.1f), std::log(0.4f), std::log(0.2f)}, {1, 4});
    const auto counts = [&](const nn::GenerationOptions& o) {
      std::vector<int> c(4, 0);
      for (int i = 0; i < 1000; ++i)
        ++c[size_t(nn::sample_tokens(logits, o, {(i + 0.5) / 1000}).item<int64_t>())];
      return c;
    };
    // 1000 evenly spaced draws: each id's count is 1000 p within one.
    const auto near = [](const std::vector<int>& c, const std::vector<double>& p) {
      for (size_t i = 0; i < 4; ++i)
        if (std::abs(c[i] - 1000 * p[i]) > 1) return false;
      return true;
    };
    CHECK(near(counts({.temperature = 1}), {0.3, 0.1, 0.4, 0.2}));
    CHECK(near(counts({.temperature = 1, .top_k = 2}), {0.3 / 0.7, 0, 0.4 / 0.7, 0}));
    CHECK(near(counts({.temperature = 1, .top_p = 0.85}), {0.3 / 0.9, 0, 0.4 / 0.9, 0.2 / 0.9}));
    CHECK(near(counts({.temperature = 1, .top_p = 0.3}), {0, 0, 1, 0}));
    CHECK(counts({.temperature = 0}) == std::vector<int>{0, 0, 1000, 0});
    // temperature 0.5 squares the probabilities: 0.09, 0.01, 0.16, 0.04 over 0.3
    CHECK(near(counts({.temperature = 0.5}), {0.3, 0.1 / 3, 0.16 / 0.3, 0.04 / 0.3}));
    auto model = data::hf::from_pretrained(reference_dir("llama"));
    const Tensor prompt = from_vector(std::vector<int64_t>{1, 2, 3}, {1, 3});
    const nn::GenerationOptions sampled{
        .max_new_tokens = 20, .temperature = 1, .top_p = 0.9, .seed = 3};
    CHECK(max_abs_diff(nn::generate(*model, prompt, sampled),
                       nn::generate(*model, prompt, sampled)) == 0);
    auto other = sampled;
    other.seed = 4;
    CHECK(max_abs_diff(nn::generate(*model, prompt, sampled), nn::generate(*model, prompt, other)) >
          0);
  }
}
