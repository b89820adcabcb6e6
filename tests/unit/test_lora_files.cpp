// PEFT adapter files: adapters PyTorch wrote (bench/pretrained/peft_reference.py: random A and B
// in PEFT's format, and the logits of the base with PEFT's update applied, in float64) give
// PyTorch's logits; weave's saved adapters are PEFT's names, shapes and config, and reload into a
// fresh base bit for bit; a merged model exports as a plain checkpoint with the adapted logits;
// files that do not fit raise, naming what.
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "helpers.h"
#include "hf_helpers.h"

using namespace weave;
using weave::test::relative_error;
using weave_test::reference_dir;
using weave_test::scratch;

namespace {

Tensor reference_tokens(const std::string& adapters) {
  return data::load_safetensors(reference_dir(adapters) + "/logits.safetensors").tensors[0].second;
}

Tensor reference_logits(const std::string& adapters) {
  for (const auto& [name, t] :
       data::load_safetensors(reference_dir(adapters) + "/logits.safetensors").tensors)
    if (name == "logits") return t;
  FAIL("no logits");
  return {};
}

// Every adapter's B drawn at random (they start at zero).
void randomize_adapters(nn::Module& model, uint64_t seed) {
  Generator g(seed);
  NoGradGuard no_grad;
  for (const auto& [name, adapter] : nn::lora_adapters(model))
    adapter->B.copy_(randn(adapter->B.shape(), {.dtype = adapter->B.dtype()}, &g) * 0.05);
}

nlohmann::json read_json(const std::string& path) {
  return nlohmann::json::parse(std::ifstream(path));
}

void write_json(const std::string& path, const nlohmann::json& j) {
  std::ofstream(path) << j.dump(2);
}

}  // namespace

TEST_SUITE("lora_files") {
  TEST_CASE("PEFT adapters PyTorch wrote give PyTorch's logits (Llama, GPT-2)") {
    for (const std::string arch : {"llama", "gpt2"}) {
      CAPTURE(arch);
      const auto config = data::hf::read_config(reference_dir(arch));
      auto model = models::from_pretrained(reference_dir(arch));
      const nn::LoRAOptions options =
          models::load_adapters(*model, config, reference_dir(arch + "_lora"));
      CHECK(options.rank == 4);
      CHECK(options.alpha == 8);
      CHECK(nn::lora_adapters(*model).size() == (arch == "llama" ? 2u * 7 : 2u * 4));
      model->eval();
      const Tensor logits = (*model)(reference_tokens(arch + "_lora"));
      const Tensor expected = reference_logits(arch + "_lora");
      CHECK(relative_error(logits.to(kFloat64), expected) < 1e-5);
      // The adapters matter: the base alone is far from them.
      auto base = models::from_pretrained(reference_dir(arch));
      CHECK(relative_error((*base)(reference_tokens(arch + "_lora")).to(kFloat64), expected) >
            1e-3);
    }
  }

  TEST_CASE("saved adapters are PEFT's files and reload into a fresh base bit for bit") {
    for (const std::string arch : {"llama", "gpt2"}) {
      CAPTURE(arch);
      const auto config = data::hf::read_config(reference_dir(arch));
      auto model = models::from_pretrained(reference_dir(arch));
      const bool llama = arch == "llama";
      // All of one kind, and one block's of another: short and full module names.
      nn::LoRAOptions lora{.rank = 3, .alpha = 5, .rslora = true, .dropout = 0.1};
      lora.targets = models::peft_targets(
          config, llama ? std::vector<std::string>{"q_proj", "model.layers.1.mlp.up_proj"}
                        : std::vector<std::string>{"c_attn", "transformer.h.1.mlp.c_proj"});
      CHECK(lora.targets.size() == 3);
      nn::add_lora(*model, lora);
      randomize_adapters(*model, 3);
      const auto dir = scratch(arch + "_saved_adapters");
      models::save_adapters(*model, config, lora, dir.string(), {.base_model = "tiny-" + arch});
      const auto saved = read_json((dir / "adapter_config.json").string());
      CHECK(saved.at("peft_type") == "LORA");
      CHECK(saved.at("r") == 3);
      CHECK(saved.at("lora_alpha") == 5.0);
      CHECK(saved.at("use_rslora") == true);
      CHECK(saved.at("lora_dropout") == 0.1);
      CHECK(saved.at("base_model_name_or_path") == "tiny-" + arch);
      CHECK(saved.at("target_modules") ==
            (llama ? nlohmann::json{"model.layers.1.mlp.up_proj", "q_proj"}
                   : nlohmann::json{"c_attn", "transformer.h.1.mlp.c_proj"}));
      std::map<std::string, Shape> shapes;
      for (const auto& e :
           data::read_safetensors_header((dir / "adapter_model.safetensors").string()).entries)
        shapes[e.name] = e.shape;
      CHECK(shapes.size() == 2 * 3);
      const std::string q = llama ? "base_model.model.model.layers.0.self_attn.q_proj"
                                  : "base_model.model.transformer.h.0.attn.c_attn";
      CHECK(shapes.at(q + ".lora_A.weight") == Shape{3, 64});
      CHECK(shapes.at(q + ".lora_B.weight") == Shape{llama ? 64 : 192, 3});
      model->eval();
      const Tensor tokens = reference_tokens(arch + "_lora");
      const Tensor logits = (*model)(tokens);
      // For the PyTorch cross-check (docs/tests.md): these adapters, with weave's logits.
      if (const char* keep = std::getenv("WEAVE_KEEP_ADAPTERS")) {
        const std::string kept = std::string(keep) + "/" + arch + "_adapters";
        models::save_adapters(*model, config, lora, kept);
        data::save_safetensors(kept + "/logits.safetensors",
                               {{"tokens", tokens}, {"logits", logits}});
      }
      auto fresh = models::from_pretrained(reference_dir(arch));
      const nn::LoRAOptions read = models::load_adapters(*fresh, config, dir.string());
      CHECK(std::set(read.targets.begin(), read.targets.end()) ==
            std::set(lora.targets.begin(), lora.targets.end()));
      CHECK(read.rslora);
      fresh->eval();
      CHECK(equal((*fresh)(tokens), logits));

      // Merged and exported, a plain checkpoint with the adapted model's logits.
      nn::merge_lora(*model);
      const auto plain = scratch(arch + "_merged");
      models::save_pretrained(*model, config, plain.string());
      auto merged = models::from_pretrained(plain.string());
      CHECK(nn::lora_adapters(*merged).empty());
      CHECK(relative_error((*merged)(tokens), logits) < 1e-6);
    }
  }

  TEST_CASE("adapter files that do not fit raise, naming what, and leave the model as it was") {
    const auto config = data::hf::read_config(reference_dir("llama"));
    auto broken = [&](const std::string& name,
                      const std::function<void(nlohmann::json&)>& edit_config,
                      const std::function<void(nn::NamedTensors&)>& edit_tensors) {
      const auto dir = scratch(name);
      weave_test::copy_checkpoint(reference_dir("llama_lora"), dir);
      auto c = read_json((dir / "adapter_config.json").string());
      edit_config(c);
      write_json((dir / "adapter_config.json").string(), c);
      const std::string weights = (dir / "adapter_model.safetensors").string();
      nn::NamedTensors tensors = data::load_safetensors(weights).tensors;
      edit_tensors(tensors);
      data::save_safetensors(weights, tensors);
      return dir.string();
    };
    auto keep = [](auto&) {};
    auto model = models::from_pretrained(reference_dir("llama"));
    auto check_raises = [&](const std::string& dir, const std::string& message) {
      CAPTURE(message);
      CHECK_THROWS_WITH_AS(models::load_adapters(*model, config, dir),
                           doctest::Contains(message.c_str()), Error);
      CHECK(nn::lora_adapters(*model).empty());
    };
    check_raises(broken(
                     "prefix", [](auto& c) { c["peft_type"] = "PREFIX_TUNING"; }, keep),
                 "peft_type 'PREFIX_TUNING' is not supported");
    check_raises(broken(
                     "target",
                     [](auto& c) {
                       c["target_modules"] = {"q_proj", "w1"};
                     },
                     keep),
                 "target module 'w1' names no projection");
    check_raises(broken(
                     "regex", [](auto& c) { c["target_modules"] = ".*proj"; }, keep),
                 "is a regular expression");
    check_raises(broken(
                     "rank", [](auto& c) { c["r"] = 8; }, keep),
                 "an adapter of rank r 8 on model.layers.0.self_attn.q_proj [64, 64]");
    check_raises(broken("shape", keep,
                        [](nn::NamedTensors& t) {
                          for (auto& [name, value] : t)
                            if (name.find("layers.1.mlp.down_proj.lora_A") != std::string::npos)
                              value = value.narrow(1, 0, 100);
                        }),
                 "model.layers.1.mlp.down_proj.lora_A.weight is float32 [4, 100]");
    check_raises(broken("missing", keep,
                        [](nn::NamedTensors& t) {
                          std::erase_if(t, [](const auto& e) {
                            return e.first.find("layers.0.self_attn.v_proj.lora_B") !=
                                   std::string::npos;
                          });
                        }),
                 "no tensor base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight");
    check_raises(broken(
                     "unexpected", [](auto& c) { c["target_modules"] = {"q_proj"}; }, keep),
                 "is no adapter that adapter_config.json's target_modules name");
    check_raises(broken(
                     "bias", [](auto& c) { c["bias"] = "all"; }, keep),
                 "bias 'all'");
    check_raises(broken(
                     "dora", [](auto& c) { c["use_dora"] = true; }, keep),
                 "use_dora true");
    check_raises(broken(
                     "pattern",
                     [](auto& c) {
                       c["rank_pattern"] = {{"q_proj", 2}};
                     },
                     keep),
                 "rank_pattern {\"q_proj\":2} is not supported");
    check_raises(broken(
                     "layers", [](auto& c) { c["layers_to_transform"] = {0}; }, keep),
                 "layers_to_transform [0]");
    {  // empty patterns, as PEFT writes them, load
      auto plain = models::from_pretrained(reference_dir("llama"));
      auto empty_patterns = [](auto& c) {
        c["rank_pattern"] = nlohmann::json::object();
        c["alpha_pattern"] = nlohmann::json::object();
        c["use_dora"] = false;
      };
      models::load_adapters(*plain, config, broken("empty", empty_patterns, keep));
      CHECK(nn::lora_adapters(*plain).size() == 14);
    }
    check_raises(scratch("nowhere").string(), "adapter_config.json");
    CHECK_THROWS_WITH_AS(models::peft_targets(config, {"c_attn"}),
                         doctest::Contains("target module 'c_attn' names no projection"), Error);
    CHECK_THROWS_WITH_AS(models::save_adapters(*model, config, {}, scratch("none").string()),
                         doctest::Contains("no adapters to save"), Error);
    models::load_adapters(*model, config, reference_dir("llama_lora"));
    CHECK_THROWS_WITH_AS(
        models::save_adapters(*model, config, {.rank = 8}, scratch("wrong_rank").string()),
        doctest::Contains("has rank 4, but the options to save say r 8"), Error);
  }
}
