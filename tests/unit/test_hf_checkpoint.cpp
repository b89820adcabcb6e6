// Hugging Face checkpoints against PyTorch: bench/pretrained/hf_reference.py wrote a tiny GPT-2
// a tiny Llama (4 query and 2 key/value heads, rotary with Llama 3's scaling, SwiGLU, RMSNorm)
// and a tiny Qwen 2 (Llama with biased q, k and v) in Hugging Face's layout, two shards with an
// index each, and their logits on fixed tokens (tests/data/hf). Generation with the key/value
// caches against full forward passes.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "helpers.h"
#include "hf_helpers.h"
#include "weave/data/hf/hf_mapping.h"

using namespace weave;
using namespace weave_test;
using weave::test::relative_error;
namespace fs = std::filesystem;

namespace {

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

}  // namespace

TEST_SUITE("hf_checkpoint") {
  TEST_CASE("GPT-2 and Llama checkpoints give PyTorch's logits; export reloads bitwise") {
    // gemma2_bf16: Gemma 2's weights rounded to bfloat16 in one file, float64 logits of those.
    for (const std::string arch : {"gpt2", "llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3",
                                   "gemma2_bf16", "mixtral", "qwen3_moe", "qwen2_moe"}) {
      CAPTURE(arch);
      const std::string dir = reference_dir(arch);
      auto model = models::from_pretrained(dir);
      const auto expected = data::load_safetensors(dir + "/logits.safetensors").tensors;
      const Tensor tokens = expected[1].first == "tokens" ? expected[1].second : expected[0].second;
      const Tensor logits = expected[0].first == "logits" ? expected[0].second : expected[1].second;
      NoGradGuard no_grad;
      model->eval();
      CHECK(max_abs_diff((*model)(tokens), logits) < 1e-5);
      if (arch == "gemma2_bf16") {  // computed in bfloat16 too: within its rounding
        auto in_bf16 = models::from_pretrained(dir);
        in_bf16->to(kBFloat16);
        const double relative =
            max_abs_diff((*in_bf16)(tokens), logits) / max(abs(logits)).item<double>();
        MESSAGE("gemma2 in bfloat16: logits within " << relative << " of float64's (relative)");
        CHECK(relative < 3e-2);
      }
      if (logits.dtype() == kFloat64) {  // Qwen 3's: float64 logits, weave's float32 within 2e-6
        const double relative =
            max_abs_diff((*model)(tokens), logits) / max(abs(logits)).item<double>();
        MESSAGE(arch << ": float32 logits within " << relative << " of float64's (relative)");
        CHECK(relative < 2e-6);
      }

      const auto config = data::hf::read_config(dir);
      const auto out = scratch(arch + "_export");
      data::hf::save_pretrained(*model, config, out.string(), {.max_shard_bytes = 300000});
      CHECK(fs::exists(out / "model.safetensors.index.json"));
      CHECK(layout_of(out.string()) == layout_of(dir));
      auto reloaded = models::from_pretrained(out.string());
      const auto before = model->named_parameters(), after = reloaded->named_parameters();
      REQUIRE(before.size() == after.size());
      for (size_t i = 0; i < before.size(); ++i) {
        CAPTURE(before[i].first);
        CHECK(before[i].first == after[i].first);
        CHECK(max_abs_diff(before[i].second, after[i].second) == 0);
      }
    }
  }

  TEST_CASE("a model built from its options exports with model_config and reloads bitwise") {
    Generator g(3);
    const models::LlamaOptions options{
        .vocab = 40,
        .dim = 16,
        .layers = 2,
        .block = {.heads = 4, .kv_heads = 2, .rotary = RotaryOptions{.base = 500000}},
        .generator = &g};
    models::Llama model(options);
    const auto config = models::model_config(options);
    CHECK(config.hidden == models::llama_hidden(16));
    const auto out = scratch("from_options");
    data::hf::save_pretrained(model, config, out.string());
    const auto read = data::hf::read_config(out.string());
    CHECK(read.kv_heads == 2);
    CHECK(read.rope_theta == 500000);
    CHECK(fs::exists(out / "generation_config.json"));
    auto reloaded = models::from_pretrained(out.string());
    NoGradGuard no_grad;
    const Tensor tokens = randint(0, 40, {2, 9}, {.dtype = kInt64}, &g);
    CHECK(max_abs_diff((*reloaded)(tokens), model(tokens)) == 0);
    // What Hugging Face's Llama cannot describe raises, naming it.
    models::LlamaOptions interleaved = options;
    interleaved.block.rotary->interleaved = true;
    CHECK_WEAVE_ERROR(models::model_config(interleaved), "hf", "interleaved true");
    CHECK_WEAVE_ERROR(models::model_config(models::GPT2Options{.untied_head = true}), "hf",
                      "untied_head");
    // Q/k norms make it Qwen 3; its head_dim is written even where it is dim / heads (a Qwen 3
    // config without one means 128).
    models::LlamaOptions qwen3 = options;
    qwen3.block.qk_norm = nn::HeadNormOptions{.eps = qwen3.block.norm_eps};
    models::Llama qwen3_model(qwen3);
    const auto qwen3_out = scratch("qwen3_from_options");
    data::hf::save_pretrained(qwen3_model, models::model_config(qwen3), qwen3_out.string());
    const auto written = nlohmann::json::parse(std::ifstream(qwen3_out / "config.json"));
    CHECK(written["model_type"] == "qwen3");
    CHECK(written["head_dim"] == 4);
    CHECK(max_abs_diff((*models::from_pretrained(qwen3_out.string()))(tokens),
                       qwen3_model(tokens)) == 0);
    models::LlamaOptions gemma_norms = qwen3;
    gemma_norms.block.qk_norm->unit_offset = true;
    CHECK_WEAVE_ERROR(models::model_config(gemma_norms), "hf", "unit_offset true");
    models::LlamaOptions both = qwen3;
    both.block.qkv_bias = true;
    CHECK_WEAVE_ERROR(models::model_config(both), "hf", "one or the other");
  }

  TEST_CASE("GPT-2's fused q/k/v read by heads, or by rows across heads, equals the whole's") {
    const std::string dir = reference_dir("gpt2");
    const auto config = data::hf::read_config(dir);
    auto whole = models::from_pretrained(dir);
    data::hf::WeightReader reader(config, dir);
    for (auto& [parameter, w] : whole->named_parameters()) {
      const std::string name = parameter;  // a copy: CAPTURE's lambda cannot take a binding
      if (name.find("attention.qkv") == std::string::npos) continue;
      CAPTURE(name);
      const int64_t rows = w.size(0);
      // the second of 4 heads, then rows that cut heads (and q, k and v) in the middle
      for (auto [begin, end] : {std::pair{rows / 4, rows / 2}, std::pair{int64_t(5), rows - 7}})
        CHECK(max_abs_diff(reader.read(name, {0, begin, end}), w.narrow(0, begin, end - begin)) ==
              0);
    }
  }

  TEST_CASE("slices read only their bytes, and element ranges equal the whole's") {
    for (const std::string arch : {"gpt2", "llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3",
                                   "mixtral", "qwen3_moe", "qwen2_moe"}) {
      CAPTURE(arch);
      const std::string dir = reference_dir(arch);
      const auto config = data::hf::read_config(dir);
      auto whole = models::from_pretrained(dir);
      data::hf::WeightReader reader(config, dir);
      Generator generator(7);
      for (auto& [parameter, w] : whole->named_parameters()) {
        const std::string name = parameter;  // a copy: CAPTURE's lambda cannot take a binding
        CAPTURE(name);
        CHECK(reader.shape(name) == w.shape());
        // A rank's piece: the second half along the last axis (columns; for Llama's stacked kv,
        // key/value heads), and along the first.
        for (const int axis : {int(w.dim()) - 1, 0}) {
          const int64_t size = w.size(axis);
          const data::hf::Slice slice{axis, size / 2, size};
          const Tensor expected = w.narrow(axis, size / 2, size - size / 2).contiguous();
          CAPTURE(axis);
          const int64_t before = reader.bytes_read();
          CHECK(max_abs_diff(reader.read(name, slice), expected) == 0);
          if (arch != "gpt2")  // float32, and no fused q/k/v: exactly the slice's bytes
            CHECK(reader.bytes_read() - before == expected.numel() * 4);
          // Flat ranges of the slice, as a flat shard cuts it: a few rows' bytes at most beyond.
          const Tensor flat = expected.reshape({expected.numel()});
          const int64_t row = expected.numel() / expected.size(0);
          const int64_t qkv =
              name.find("qkv") != std::string::npos ? 3 * config.dim / config.heads : 1;
          for (int trial = 0; trial < 4; ++trial) {
            const int64_t first = generator.integer(0, flat.numel());
            const int64_t count = generator.integer(1, flat.numel() - first + 1);
            CAPTURE(first);
            CAPTURE(count);
            const int64_t at = reader.bytes_read();
            CHECK(max_abs_diff(reader.read_elements(name, slice, first, count),
                               flat.narrow(0, first, count)) == 0);
            CHECK(reader.bytes_read() - at <= 4 * (count + 4 * row * qkv));
          }
        }
      }
      CHECK_THROWS_WITH_AS(reader.read("norm.weight", {0, 0, 10 * config.dim}),
                           doctest::Contains("no slice"), Error);
      CHECK_THROWS_WITH_AS(reader.read("blocks.9.norm1.weight"),
                           doctest::Contains("has no counterpart"), Error);
    }
  }

  TEST_CASE("bad checkpoints raise, naming what is wrong") {
    const auto broken = [](const std::string& name) {
      const auto dir = scratch(name);
      copy_checkpoint(reference_dir("llama"), dir);
      return dir;
    };
    auto dir = broken("missing_shard");
    fs::remove(dir / "model-00002-of-00002.safetensors");
    CHECK_THROWS_WITH_AS(models::from_pretrained(dir.string()),
                         doctest::Contains("model-00002-of-00002.safetensors (holding"), Error);
    dir = broken("wrong_shape");
    edit_config(dir, [](auto& c) { c["intermediate_size"] = 160; });
    CHECK_THROWS_WITH_AS(models::from_pretrained(dir.string()),
                         doctest::Contains("has shape [176, 64], but the config's model needs "
                                           "[160, 64]"),
                         Error);
    dir = broken("unknown");
    edit_config(dir, [](auto& c) { c["model_type"] = "bert"; });
    CHECK_THROWS_WITH_AS(models::from_pretrained(dir.string()),
                         doctest::Contains("unknown architecture: model_type 'bert'"), Error);
    dir = broken("bias");
    edit_config(dir, [](auto& c) { c["attention_bias"] = true; });
    CHECK_THROWS_WITH_AS(models::from_pretrained(dir.string()),
                         doctest::Contains("attention_bias true is not supported"), Error);
    dir = broken("window_types");
    edit_config(dir, [](auto& c) {
      c["model_type"] = "mistral";
      c["sliding_window"] = 4;
      c["layer_types"] = {"sliding_attention", "local"};
    });
    CHECK_THROWS_WITH_AS(models::from_pretrained(dir.string()),
                         doctest::Contains("layer_types entry 'local' is not supported"), Error);
    dir = broken("llama_as_qwen2");  // Qwen 2's biases are missing from Llama's files
    edit_config(dir, [](auto& c) { c["model_type"] = "qwen2"; });
    CHECK_THROWS_WITH_AS(models::from_pretrained(dir.string()),
                         doctest::Contains("lacks 6 tensor(s) the config's model needs: "
                                           "model.layers.0.self_attn.q_proj.bias"),
                         Error);
    dir = broken("llama_as_qwen3");  // Qwen 3's q/k norms are missing from Llama's files
    edit_config(dir, [](auto& c) { c["model_type"] = "qwen3"; });
    CHECK_THROWS_WITH_AS(models::from_pretrained(dir.string()),
                         doctest::Contains("model.layers.0.self_attn.k_norm.weight"), Error);
    dir = broken("untied");
    edit_config(dir, [](auto& c) { c["tie_word_embeddings"] = true; });  // lm_head unused
    auto tied = models::from_pretrained(dir.string());
    CHECK(dynamic_cast<models::Llama&>(*tied).head == nullptr);
  }

  TEST_CASE("greedy decoding with the caches equals the argmax of full forward passes") {
    for (const std::string arch : {"gpt2", "llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3",
                                   "mixtral", "qwen3_moe", "qwen2_moe"}) {
      CAPTURE(arch);
      auto model = models::from_pretrained(reference_dir(arch));
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

  // hf_reference.py's float64 gradients of the mean next-token cross-entropy (<arch>_gradients:
  // q/k projections, norms, Gemma's post-norms, q/k norms, experts, routers, the shared expert's
  // gate), against weave's model in float64 on the same tokens, through the checkpoint's names.
  TEST_CASE("gradients of the newer architectures equal the reference's (float64)") {
    for (const std::string arch :
         {"qwen3", "mistral", "gemma2", "gemma3", "mixtral", "qwen3_moe", "qwen2_moe"}) {
      CAPTURE(arch);
      const std::string dir = reference_dir(arch);
      auto model = models::from_pretrained(dir);
      model->to(kFloat64);
      model->eval();  // no balancing loss: the reference's loss is the cross-entropy alone
      Tensor tokens;
      for (const auto& [name, t] : data::load_safetensors(dir + "/logits.safetensors").tensors)
        if (name == "tokens") tokens = t;
      const Tensor logits = (*model)(tokens);
      const int64_t vocab = logits.size(-1), length = tokens.size(1) - 1;
      cross_entropy(logits.narrow(1, 0, length).reshape({-1, vocab}),
                    tokens.narrow(1, 1, length).reshape({-1}))
          .backward();
      std::map<std::string, Tensor> expected;
      for (const auto& [name, t] :
           data::load_safetensors(dir + "/../" + arch + "_gradients.safetensors").tensors)
        expected[name] = t;
      std::map<std::string, Tensor> params;
      for (const auto& [name, p] : model->named_parameters()) params[name] = p;
      size_t compared = 0;
      for (const auto& m : data::hf::detail::mappings(data::hf::read_config(dir)))
        for (size_t i = 0; i < m.sources.size(); ++i) {
          const auto want = expected.find(m.sources[i]);
          if (want == expected.end()) continue;
          const std::string source = m.sources[i];  // CAPTURE needs a variable
          CAPTURE(source);
          const Tensor grad = params.at(m.weave).grad();
          REQUIRE(grad.defined());
          const Tensor got = m.layout == data::hf::detail::Layout::Stacked
                                 ? grad.select(0, int64_t(i))
                                 : grad.reshape(want->second.shape());
          CHECK(relative_error(got, want->second) < 1e-9);
          ++compared;
        }
      CHECK(compared == expected.size());
    }
  }

  // Qwen 2's reference weights with windows of 3 on layer 1 only (max_window_layers 1), against
  // hf_reference.py's float64 logits of that config (qwen2_window_logits.safetensors).
  TEST_CASE("windows on some layers (Qwen's max_window_layers, layer_types) give the reference's") {
    const auto dir = scratch("qwen2_window");
    copy_checkpoint(reference_dir("qwen2"), dir);
    edit_config(dir, [](auto& c) {
      c["use_sliding_window"] = true;
      c["sliding_window"] = 3;
      c["max_window_layers"] = 1;
    });
    const auto expected =
        data::load_safetensors(reference_dir("qwen2") + "/../qwen2_window_logits.safetensors");
    Tensor tokens, logits;
    for (const auto& [name, t] : expected.tensors) (name == "tokens" ? tokens : logits) = t;
    auto model = models::from_pretrained(dir.string());
    NoGradGuard no_grad;
    const Tensor windowed = (*model)(tokens);
    const double relative = max_abs_diff(windowed, logits) / max(abs(logits)).item<double>();
    MESSAGE("Qwen 2 with a window on layer 1: float32 within " << relative << " (relative)");
    CHECK(relative < 2e-6);
    const Tensor unwindowed = (*models::from_pretrained(reference_dir("qwen2")))(tokens);
    CHECK(max_abs_diff(unwindowed, logits) > 1e-3);  // the window matters on these tokens
    // Exported: layer_types and max_window_layers say the same; read back, the same model.
    const auto out = scratch("qwen2_window_export");
    data::hf::save_pretrained(*model, data::hf::read_config(dir.string()), out.string());
    const auto written = nlohmann::json::parse(std::ifstream(out / "config.json"));
    CHECK(written["layer_types"] == nlohmann::json{"full_attention", "sliding_attention"});
    CHECK(written["max_window_layers"] == 1);
    CHECK(max_abs_diff((*models::from_pretrained(out.string()))(tokens), windowed) == 0);
    // Built from options: a window on every layer exports as Mistral, on some as Qwen's.
    Generator g(4);
    models::LlamaOptions options;
    options.vocab = 40, options.dim = 16, options.layers = 2, options.generator = &g;
    options.block.heads = 4, options.block.window = 3;
    CHECK(models::model_config(options).sliding_window == 3);
    models::Llama mistral(options);
    const auto mistral_out = scratch("mistral_from_options");
    data::hf::save_pretrained(mistral, models::model_config(options), mistral_out.string());
    CHECK(nlohmann::json::parse(std::ifstream(mistral_out / "config.json"))["model_type"] ==
          "mistral");
    const Tensor short_tokens = randint(0, 40, {2, 9}, {.dtype = kInt64}, &g);
    CHECK(max_abs_diff((*models::from_pretrained(mistral_out.string()))(short_tokens),
                       mistral(short_tokens)) == 0);
    options.windowed_layers = {true, false};
    CHECK_WEAVE_ERROR(
        data::hf::save_pretrained(models::Llama(options), models::model_config(options),
                                  scratch("mistral_some_layers").string()),
        "hf", "windows every layer or none");
    options.block.attention_softcap = 30;
    CHECK_WEAVE_ERROR(models::model_config(options), "hf", "attention_softcap 30");
  }

  TEST_CASE("a model with SwiGLU experts exports as Mixtral, or with q/k norms as Qwen 3 MoE") {
    Generator g(6);
    models::LlamaOptions options;
    options.vocab = 40, options.dim = 16, options.layers = 2, options.generator = &g;
    options.block.heads = 4;
    options.block.moe = nn::MoEOptions{
        .hidden = 16, .ffn = 24, .router = {.experts = 4, .top_k = 2}, .seed = 3, .gated = true};
    const Tensor tokens = randint(0, 40, {2, 9}, {.dtype = kInt64}, &g);
    for (const bool qwen : {false, true}) {
      CAPTURE(qwen);
      if (qwen) options.block.qk_norm = nn::HeadNormOptions{.eps = options.block.norm_eps};
      models::Llama model(options);
      const auto out = scratch(qwen ? "qwen3_moe_from_options" : "mixtral_from_options");
      data::hf::save_pretrained(model, models::model_config(options), out.string());
      const auto written = nlohmann::json::parse(std::ifstream(out / "config.json"));
      CHECK(written["model_type"] == (qwen ? "qwen3_moe" : "mixtral"));
      NoGradGuard no_grad;
      CHECK(max_abs_diff((*models::from_pretrained(out.string()))(tokens), model(tokens)) == 0);
    }
    options.block.qk_norm = std::nullopt, options.block.qkv_bias = true;  // Qwen 2 MoE's
    options.block.moe->shared_ffn = 8, options.block.moe->shared_gate = true;
    {
      models::Llama model(options);
      const auto out = scratch("qwen2_moe_from_options");
      data::hf::save_pretrained(model, models::model_config(options), out.string());
      CHECK(nlohmann::json::parse(std::ifstream(out / "config.json"))["model_type"] == "qwen2_moe");
      NoGradGuard no_grad;
      CHECK(max_abs_diff((*models::from_pretrained(out.string()))(tokens), model(tokens)) == 0);
    }
    options.block.moe->shared_gate = false;  // an ungated shared expert (DeepSeek's): no name
    CHECK_WEAVE_ERROR(models::model_config(options), "hf", "gated, with q/k/v biases");
    options.block.moe->gated = false;  // GELU experts with biases: no Hugging Face name
    CHECK_WEAVE_ERROR(models::model_config(options), "hf", "SwiGLU experts");
  }

  TEST_CASE("generation stops each row at end-of-text, and ends when every row has") {
    auto model = models::from_pretrained(reference_dir("llama"));
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
    auto model = models::from_pretrained(reference_dir("llama"));
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
