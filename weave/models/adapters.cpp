// PEFT adapter files: the architecture's projections by Hugging Face module, adapter_config.json,
// and adapter_model.safetensors in and out of any layout.
#include "weave/models/adapters.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "weave/autograd/grad_mode.h"
#include "weave/data/files.h"
#include "weave/data/hf/hf_mapping.h"
#include "weave/data/safetensors.h"
#include "weave/parallel/checkpoint/pretrained.h"
#include "weave/parallel/core/agree.h"
#include "weave/parallel/model_parallel/tensor_parallel.h"

namespace weave::models {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using data::hf::detail::Layout;
constexpr const char* kAdapters = "adapters";
constexpr const char* kConfigFile = "adapter_config.json";
constexpr const char* kWeightsFile = "adapter_model.safetensors";
constexpr const char* kPrefix = "base_model.model.";

// One projection that takes an adapter: weave's path, Hugging Face's module, its sizes.
struct Site {
  std::string path;    // "blocks.0.attention.q"
  std::string module;  // "model.layers.0.self_attn.q_proj"
  int64_t in = 0, out = 0;
  bool heads_qkv = false;  // GPT-2's c_attn: B's rows reordered as the weight's
};

std::string without_suffix(const std::string& name, const std::string& suffix) {
  return name.ends_with(suffix) ? name.substr(0, name.size() - suffix.size()) : name;
}

// The architecture's projections, from the checkpoint mappings: the linear pieces the layers of
// nn/ adapt (nn/lora.h) and the halves of their stacked ones; no expert's.
std::vector<Site> sites_of(const data::hf::ModelConfig& config) {
  static const std::set<std::string> linears = {"q", "out", "down", "qkv", "fc1", "fc2"};
  std::vector<Site> sites;
  for (const data::hf::detail::Mapping& m : data::hf::detail::mappings(config)) {
    if (m.weave.find(".moe.") != std::string::npos) continue;
    const size_t dot = m.weave.rfind('.');
    const std::string layer = m.weave.substr(0, dot + 1), member = m.weave.substr(dot + 1);
    if (m.layout == Layout::Stacked && (member == "kv" || member == "gate_up")) {
      const char* halves[2][2] = {{"k", "v"}, {"gate", "up"}};
      for (int part = 0; part < 2; ++part)
        sites.push_back({layer + halves[member == "gate_up"][part],
                         without_suffix(m.sources[size_t(part)], ".weight"),
                         m.shapes[size_t(part)][1], m.shapes[size_t(part)][0]});
      continue;
    }
    const std::string path = without_suffix(m.weave, ".weight");
    if (member != "weight" || path.rfind('.') == std::string::npos ||
        !linears.count(path.substr(path.rfind('.') + 1)))
      continue;
    const Shape& shape = m.shapes[0];
    const bool transposed = m.layout == Layout::Transposed || m.layout == Layout::HeadsQKV;
    sites.push_back({path, without_suffix(m.sources[0], ".weight"), shape[transposed ? 0 : 1],
                     shape[transposed ? 1 : 0], m.layout == Layout::HeadsQKV});
  }
  return sites;
}

// Whether PEFT's target names module: the module itself or its last components.
bool peft_names(const std::string& target, const std::string& module) {
  return module == target || module.ends_with("." + target);
}

// B's rows from the file's order (q, k, v, then head) to weave's (head, then q, k, v), or back.
Tensor reorder_qkv_rows(const Tensor& b, int64_t heads, bool to_weave) {
  const int64_t out = b.size(0), head_dim = out / (3 * heads);
  const Shape from =
      to_weave ? Shape{3, heads, head_dim, b.size(1)} : Shape{heads, 3, head_dim, b.size(1)};
  return b.reshape(from).transpose(0, 1).contiguous().reshape({out, b.size(1)});
}

std::string tensor_name(const Site& site, char factor) {
  return fmt::format("{}{}.lora_{}.weight", kPrefix, site.module, factor);
}

// The sites whose paths ("blocks.0.attention.q") have adapters.
std::vector<const Site*> adapted(const std::vector<Site>& sites,
                                 const std::set<std::string>& paths) {
  std::vector<const Site*> out;
  for (const Site& site : sites)
    if (paths.count(site.path)) out.push_back(&site);
  return out;
}

// target_modules for the adapted sites: a short module name where it names exactly those, else
// the full modules.
json target_modules(const std::vector<Site>& sites, const std::vector<const Site*>& chosen) {
  std::set<std::string> chosen_modules, shorts, out;
  for (const Site* site : chosen) {
    chosen_modules.insert(site->module);
    shorts.insert(site->module.substr(site->module.rfind('.') + 1));
  }
  for (const std::string& name : shorts) {
    bool exact = true;
    for (const Site& site : sites)
      if (peft_names(name, site.module) && !chosen_modules.count(site.module)) exact = false;
    if (exact) {
      out.insert(name);
      continue;
    }
    for (const std::string& module : chosen_modules)
      if (peft_names(name, module)) out.insert(module);
  }
  return json(std::vector<std::string>(out.begin(), out.end()));
}

json config_json(const data::hf::ModelConfig& config, const nn::LoRAOptions& options,
                 const json& modules, const std::string& base_model) {
  return json{{"peft_type", "LORA"},
              {"task_type", "CAUSAL_LM"},
              {"r", options.rank},
              {"lora_alpha", options.alpha},
              {"lora_dropout", options.dropout},
              {"use_rslora", options.rslora},
              {"target_modules", modules},
              {"base_model_name_or_path", base_model},
              {"bias", "none"},
              {"fan_in_fan_out", config.architecture == "gpt2"},
              {"inference_mode", true},
              {"init_lora_weights", true},
              {"modules_to_save", nullptr}};
}

}  // namespace

std::vector<std::string> peft_targets(const data::hf::ModelConfig& config,
                                      const std::vector<std::string>& modules) {
  const std::vector<Site> sites = sites_of(config);
  std::vector<std::string> targets;
  for (const std::string& module : modules) {
    bool found = false;
    for (const Site& site : sites)
      if (module == "all-linear" || peft_names(module, site.module)) {
        found = true;
        if (std::find(targets.begin(), targets.end(), site.path) == targets.end())
          targets.push_back(site.path);
      }
    WEAVE_CHECK(found, kAdapters,
                "target module '{}' names no projection of this {} model; expected one of its "
                "attention and MLP projections (such as '{}'), or all-linear",
                module, config.architecture,
                sites.empty() ? "" : sites[0].module.substr(sites[0].module.rfind('.') + 1));
  }
  return targets;
}

void save_adapters(nn::Module& model, const data::hf::ModelConfig& config,
                   const nn::LoRAOptions& options, const std::string& dir,
                   const AdapterSaveOptions& save, const std::optional<dist::Group>& group) {
  NoGradGuard no_grad;
  const bool split = dist::initialized() || group.has_value();
  const std::optional<dist::Group> g =
      split ? std::optional(group.value_or(dist::world())) : std::nullopt;
  auto is_adapter = [](const std::string& name) {
    return name.find("_lora.") != std::string::npos;
  };
  nn::NamedTensors whole;
  if (split) {
    whole = parallel::gather_whole_state_dict(model, *g, is_adapter);
  } else {
    for (const auto& [name, t] : model.state_dict())
      if (is_adapter(name)) whole.emplace_back(name, t);
  }
  auto write = [&] {
    if (split && g->rank() != 0) return;
    WEAVE_CHECK(!whole.empty(), kAdapters, "the model has no adapters to save; hint: add_lora");
    std::map<std::string, Tensor> values(whole.begin(), whole.end());
    const std::vector<Site> sites = sites_of(config);
    std::set<std::string> paths;
    for (const auto& [name, t] : whole) paths.insert(name.substr(0, name.rfind("_lora.")));
    const std::vector<const Site*> chosen = adapted(sites, paths);
    WEAVE_CHECK(chosen.size() == paths.size(), kAdapters,
                "{} of the model's {} adapters sit on no projection this {} checkpoint names",
                paths.size() - chosen.size(), paths.size(), config.architecture);
    nn::NamedTensors tensors;
    for (const Site* site : chosen) {
      const Tensor a = values.at(site->path + "_lora.A").contiguous();
      WEAVE_CHECK(a.size(0) == options.rank, kAdapters,
                  "the adapter on {} has rank {}, but the options to save say r {}; hint: save "
                  "with the options add_lora was given",
                  site->path, a.size(0), options.rank);
      Tensor b = values.at(site->path + "_lora.B");
      if (site->heads_qkv) b = reorder_qkv_rows(b, config.heads, /*to_weave=*/false);
      tensors.emplace_back(tensor_name(*site, 'A'), a);
      tensors.emplace_back(tensor_name(*site, 'B'), b.contiguous());
    }
    fs::create_directories(dir);
    data::save_safetensors((fs::path(dir) / kWeightsFile).string(), tensors);
    data::write_file_atomically(
        (fs::path(dir) / kConfigFile).string(),
        config_json(config, options, target_modules(sites, chosen), save.base_model).dump(2) +
            "\n");
  };
  if (split)
    parallel::detail::run_together(kAdapters, *g, "save adapters to " + dir, write);
  else
    write();
}

nn::LoRAOptions read_adapter_config(const std::string& dir, const data::hf::ModelConfig& config) {
  const std::string path = (fs::path(dir) / kConfigFile).string();
  json c;
  try {
    c = json::parse(data::read_file(path));
  } catch (const json::exception& e) {
    WEAVE_FAIL(kAdapters, "{}: not valid JSON ({})", path, e.what());
  }
  auto field = [&](const char* name) -> const json& {
    WEAVE_CHECK(c.contains(name), kAdapters, "{}: no '{}'", path, name);
    return c.at(name);
  };
  const std::string type = field("peft_type").get<std::string>();
  WEAVE_CHECK(type == "LORA", kAdapters,
              "{}: peft_type '{}' is not supported; weave loads LORA adapters", path, type);
  const std::string bias = c.value("bias", "none");
  WEAVE_CHECK(bias == "none", kAdapters,
              "{}: bias '{}' trains the base's biases too, which weave's adapters do not; "
              "expected \"none\"",
              path, bias);
  const json saved = c.value("modules_to_save", json());
  WEAVE_CHECK(saved.is_null() || saved.empty(), kAdapters,
              "{}: modules_to_save {} is not supported (whole modules trained beside the "
              "adapters)",
              path, saved.dump());
  // What would change the update in ways weave's adapters do not follow: refused, not ignored.
  for (const char* name : {"rank_pattern", "alpha_pattern", "layers_to_transform", "layers_pattern",
                           "use_dora", "lora_bias"}) {
    const json value = c.value(name, json());
    WEAVE_CHECK(value.is_null() || value.empty() || value == false, kAdapters,
                "{}: {} {} is not supported (weave's adapters share one rank and alpha, on "
                "every layer, without DoRA or biases)",
                path, name, value.dump());
  }
  const json& modules = field("target_modules");
  WEAVE_CHECK(modules.is_array() || modules == "all-linear", kAdapters,
              "{}: target_modules {} is a regular expression, which weave does not match; "
              "expected a list of module names",
              path, modules.dump());
  nn::LoRAOptions options;
  options.rank = field("r").get<int64_t>();
  options.alpha = field("lora_alpha").get<double>();
  options.dropout = c.value("lora_dropout", 0.0);
  options.rslora = c.value("use_rslora", false);
  options.targets =
      peft_targets(config, modules.is_array() ? modules.get<std::vector<std::string>>()
                                              : std::vector<std::string>{"all-linear"});
  return options;
}

namespace {

// The file's tensors as weave's whole adapter parameters ("<path>_lora.A", "_lora.B"), each
// checked against the sites `targets` name and the rank.
nn::NamedTensors whole_adapters(const std::string& dir, const data::hf::ModelConfig& config,
                                const nn::LoRAOptions& options) {
  const std::string path = (fs::path(dir) / kWeightsFile).string();
  const data::SafetensorsFile file = data::load_safetensors(path);
  std::map<std::string, Tensor> held(file.tensors.begin(), file.tensors.end());
  nn::NamedTensors out;
  for (const Site& site : sites_of(config)) {
    if (std::find(options.targets.begin(), options.targets.end(), site.path) ==
        options.targets.end())
      continue;
    for (const char factor : {'A', 'B'}) {
      const std::string name = tensor_name(site, factor);
      const auto found = held.find(name);
      WEAVE_CHECK(found != held.end(), kAdapters,
                  "{}: no tensor {} (target_modules name {}); hint: the adapters of another "
                  "model?",
                  path, name, site.module);
      const Shape expected =
          factor == 'A' ? Shape{options.rank, site.in} : Shape{site.out, options.rank};
      WEAVE_CHECK(found->second.shape() == expected && is_floating(found->second.dtype()),
                  kAdapters,
                  "{}: {} is {} {}, but an adapter of rank r {} on {} [{}, {}] is a floating {}",
                  path, name, found->second.dtype(), found->second.shape(), options.rank,
                  site.module, site.out, site.in, expected);
      Tensor value = found->second;
      if (factor == 'B' && site.heads_qkv)
        value = reorder_qkv_rows(value, config.heads, /*to_weave=*/true);
      out.emplace_back(site.path + "_lora." + factor, value);
      held.erase(found);
    }
  }
  WEAVE_CHECK(held.empty(), kAdapters,
              "{}: tensor {} is no adapter that adapter_config.json's target_modules name", path,
              held.empty() ? "" : held.begin()->first);
  return out;
}

}  // namespace

nn::LoRAOptions load_adapters(nn::Module& model, const data::hf::ModelConfig& config,
                              const std::string& dir) {
  const std::optional<dist::Group> group =
      dist::initialized() ? std::optional(dist::world()) : std::nullopt;  // every rank raises
  nn::LoRAOptions options;
  nn::NamedTensors whole;
  auto read = [&] {
    options = read_adapter_config(dir, config);
    whole = whole_adapters(dir, config, options);
    nn::add_lora(model, options, /*every_target=*/false);
  };
  if (group)
    parallel::detail::run_together(kAdapters, *group, "load adapters from " + dir, read);
  else
    read();
  std::set<std::string> mine;
  for (const auto& [name, p] : model.named_parameters()) mine.insert(name);
  std::erase_if(whole, [&](const auto& entry) { return !mine.count(entry.first); });
  model.load_state_dict(parallel::shard_state_dict(whole, model), /*strict=*/false);
  return options;
}

}  // namespace weave::models
