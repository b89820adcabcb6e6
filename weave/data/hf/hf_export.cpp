// Hugging Face exports, one parameter at a time: weave's layouts viewed as Hugging Face's (no
// copies; the safetensors writer converts a piece at a time), shards planned from the config.
#include <nlohmann/json.hpp>
#include <regex>

#include "weave/data/hf/hf_architecture.h"
#include "weave/data/hf/hf_checkpoint.h"
#include "weave/data/hf/hf_mapping.h"
#include "weave/data/safetensors.h"
#include "weave/data/staged_directory.h"

namespace weave::data::hf {

using namespace detail;

namespace {

using json = nlohmann::json;
constexpr const char* kHfExport = "hf";

// The Hugging Face tensors of one weave tensor W (whole), as views of it whose row-major order
// is the file's.
std::vector<Tensor> source_views(const Mapping& m, const Tensor& w, const ModelConfig& c) {
  switch (m.layout) {
    case Layout::Same:
      return {w};
    case Layout::Transposed:
      return {w.t()};
    case Layout::Stacked:
      return {w.select(0, 0), w.select(0, 1)};
    case Layout::HeadsQKV: {  // W rows (head, q|k|v, d) -> S^T rows (q|k|v, head, d)
      const int64_t head_dim = c.dim / c.heads;
      if (w.dim() == 1) return {w.reshape({c.heads, 3, head_dim}).transpose(0, 1)};
      return {w.reshape({c.heads, 3, head_dim, c.dim}).permute({3, 1, 0, 2})};
    }
  }
  WEAVE_FAIL(kHfExport, "unknown layout");
}

}  // namespace

bool is_model_file(const std::string& name) {
  static const std::regex shard(R"((model|pytorch_model)-\d+-of-\d+\.(safetensors|bin))");
  for (const char* fixed :
       {"config.json", "generation_config.json", "model.safetensors",
        "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json"})
    if (name == fixed) return true;
  return std::regex_match(name, shard);
}

std::vector<std::string> parameter_names(const ModelConfig& config) {
  std::vector<std::string> names;
  for (const Mapping& m : mappings(config)) names.push_back(m.weave);
  return names;
}

struct PretrainedWriter::Impl {
  ModelConfig config;
  SaveOptions options;
  StagedDirectory staged;  // the export's files, swapped in as one unit at finish()
  std::string dir = staged.path();
  std::vector<Mapping> all = mappings(config);
  std::vector<std::string> names;  // all's weave names
  // The files' tensors, and the file each mapping's sources go to.
  std::vector<std::vector<SafetensorsSpec>> files{1};
  std::vector<std::vector<size_t>> file_of;
  std::unique_ptr<SafetensorsWriter> open;
  size_t open_file = 0, next = 0;

  Impl(ModelConfig c, const std::string& d, SaveOptions o)
      : config(std::move(c)), options(o), staged(d, is_model_file) {
    // Shards of at most max_shard_bytes (a larger tensor alone in one), in the mappings' order.
    uint64_t shard_bytes = 0;
    for (const Mapping& m : all) {
      names.push_back(m.weave);
      file_of.emplace_back();
      for (size_t k = 0; k < m.sources.size(); ++k) {
        const uint64_t bytes = uint64_t(m.shapes[k].numel()) * itemsize(config.dtype);
        if (shard_bytes > 0 && shard_bytes + bytes > options.max_shard_bytes)
          files.emplace_back(), shard_bytes = 0;
        files.back().push_back({m.sources[k], config.dtype, m.shapes[k]});
        file_of.back().push_back(files.size() - 1);
        shard_bytes += bytes;
      }
    }
  }

  std::string file_name(size_t i) const {
    return files.size() == 1
               ? "model.safetensors"
               : fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, files.size());
  }

  // The writer of file i (the ones before it committed).
  SafetensorsWriter& writer(size_t i) {
    if (open && open_file != i) open->commit(), open.reset();
    if (!open) {
      open = std::make_unique<SafetensorsWriter>(dir + "/" + file_name(i), files[i],
                                                 Metadata{{"format", "pt"}});
      open_file = i;
    }
    return *open;
  }

  void write_index() const {
    json weight_map = json::object();
    uint64_t total = 0;
    for (size_t i = 0; i < files.size(); ++i)
      for (const SafetensorsSpec& spec : files[i]) {
        weight_map[spec.name] = file_name(i);
        total += uint64_t(spec.shape.numel()) * itemsize(spec.dtype);
      }
    write_file_atomically(
        dir + "/model.safetensors.index.json",
        json{{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}}.dump(2));
  }

  // config.json and generation_config.json: the special tokens' ids are the config's, or the
  // tokenizer's where it names none.
  void write_configs() const {
    json c = json::parse(config_json(config));
    if (options.tokenizer) {
      options.tokenizer->save_pretrained(dir);
      const std::optional<int32_t> eos = options.tokenizer->end_of_text();
      const std::optional<int32_t> begin = options.tokenizer->token_id("<|begin_of_text|>");
      const std::optional<int32_t> bos = begin ? begin : eos;
      if (!c.contains("bos_token_id") && bos) c["bos_token_id"] = *bos;
      if (!c.contains("eos_token_id") && eos) c["eos_token_id"] = *eos;
    }
    json generation = {{"_from_model_config", true}};
    for (const char* key : {"bos_token_id", "eos_token_id"})
      if (c.contains(key)) generation[key] = c[key];
    write_file_atomically(dir + "/generation_config.json", generation.dump(2));
    write_file_atomically(dir + "/config.json", c.dump(2));
  }
};

PretrainedWriter::PretrainedWriter(ModelConfig config, std::string dir, SaveOptions options)
    : impl_(std::make_unique<Impl>(std::move(config), dir, options)) {}
PretrainedWriter::~PretrainedWriter() = default;

const std::vector<std::string>& PretrainedWriter::names() const {
  return impl_->names;
}

void PretrainedWriter::write(const std::string& name, const Tensor& whole) {
  Impl& w = *impl_;
  WEAVE_CHECK(w.next < w.all.size() && name == w.all[w.next].weave, kHfExport,
              "{} written when the export expects {}; hint: write the parameters in names()'s "
              "order",
              name, w.next < w.all.size() ? w.all[w.next].weave : "nothing more");
  const Mapping& m = w.all[w.next];
  WEAVE_CHECK(whole.defined() && whole.shape() == weave_shape(m), kHfExport,
              "{} is {}, but the config's model has {}; hint: save the whole parameter (a split "
              "model: parallel::save_pretrained)",
              name, whole.defined() ? whole.shape().str() : "undefined", weave_shape(m));
  const std::vector<Tensor> views = source_views(m, whole.detach(), w.config);
  for (size_t k = 0; k < views.size(); ++k) w.writer(w.file_of[w.next][k]).write(views[k]);
  ++w.next;
}

void PretrainedWriter::finish() {
  Impl& w = *impl_;
  WEAVE_CHECK(w.next == w.all.size(), kHfExport, "finished with {} of {} parameters written",
              w.next, w.all.size());
  if (w.open) w.open->commit(), w.open.reset();
  if (w.files.size() > 1) w.write_index();
  w.write_configs();
  w.staged.commit();
}

void save_pretrained(const nn::Module& model, const ModelConfig& config, const std::string& dir,
                     const SaveOptions& options) {
  std::map<std::string, Tensor> params;
  for (const auto& [name, p] : model.named_parameters()) params[name] = p;
  PretrainedWriter out(config, dir, options);
  for (const std::string& name : out.names()) {
    const auto found = params.find(name);
    WEAVE_CHECK(found != params.end(), kHfExport,
                "the model has no parameter {}, which a {} checkpoint holds; hint: save the whole "
                "model (a split or sharded one: parallel::save_pretrained)",
                name, architecture(config.architecture).display);
    out.write(name, found->second);
  }
  out.finish();
}

}  // namespace weave::data::hf
