// Hugging Face's names and layouts for GPT-2 and Llama, and the reads and writes that convert
// between them and weave's, slice by slice.
#include "weave/data/hf_checkpoint.h"

#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "weave/autograd/grad_mode.h"
#include "weave/data/safetensors.h"

namespace weave::data::hf {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;
constexpr const char* kHf = "hf";

// How a weave tensor W is made of its Hugging Face sources.
enum class Layout {
  Same,        // W = S
  Transposed,  // W = S^T (GPT-2's Conv1D weights, [in, out])
  Stacked,     // W = stack(S0, S1) (Llama's k/v and gate/up)
  HeadsQKV,    // GPT-2's c_attn: S^T rows (q|k|v, head, d) -> W rows (head, q|k|v, d)
};

struct Mapping {
  std::string weave;
  std::vector<std::string> sources;
  Layout layout;
  std::vector<Shape> shapes;  // the sources', as the config gives them
};

std::vector<Mapping> gpt2_mappings(const ModelConfig& c) {
  const int64_t D = c.dim, F = c.hidden;
  std::vector<Mapping> m{
      {"tokens.weight", {"transformer.wte.weight"}, Layout::Same, {{c.vocab, D}}},
      {"positions.weight", {"transformer.wpe.weight"}, Layout::Same, {{c.max_positions, D}}}};
  const auto add = [&](std::string weave, std::string source, Layout layout, Shape shape) {
    m.push_back({std::move(weave), {std::move(source)}, layout, {std::move(shape)}});
  };
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string w = "blocks." + std::to_string(i) + ".";
    const std::string h = "transformer.h." + std::to_string(i) + ".";
    for (auto [mine, theirs] : {std::pair{"norm1", "ln_1"}, std::pair{"norm2", "ln_2"}}) {
      add(w + mine + ".weight", h + theirs + ".weight", Layout::Same, {D});
      add(w + mine + ".bias", h + theirs + ".bias", Layout::Same, {D});
    }
    add(w + "attention.qkv.weight", h + "attn.c_attn.weight", Layout::HeadsQKV, {D, 3 * D});
    add(w + "attention.qkv.bias", h + "attn.c_attn.bias", Layout::HeadsQKV, {3 * D});
    add(w + "attention.out.weight", h + "attn.c_proj.weight", Layout::Transposed, {D, D});
    add(w + "attention.out.bias", h + "attn.c_proj.bias", Layout::Same, {D});
    add(w + "mlp.fc1.weight", h + "mlp.c_fc.weight", Layout::Transposed, {D, F});
    add(w + "mlp.fc1.bias", h + "mlp.c_fc.bias", Layout::Same, {F});
    add(w + "mlp.fc2.weight", h + "mlp.c_proj.weight", Layout::Transposed, {F, D});
    add(w + "mlp.fc2.bias", h + "mlp.c_proj.bias", Layout::Same, {D});
  }
  add("norm.weight", "transformer.ln_f.weight", Layout::Same, {D});
  add("norm.bias", "transformer.ln_f.bias", Layout::Same, {D});
  return m;
}

std::vector<Mapping> llama_mappings(const ModelConfig& c) {
  const int64_t D = c.dim, F = c.hidden, KV = c.kv_heads * (c.dim / c.heads);
  std::vector<Mapping> m{
      {"embedding.weight", {"model.embed_tokens.weight"}, Layout::Same, {{c.vocab, D}}}};
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string w = "blocks." + std::to_string(i) + ".";
    const std::string h = "model.layers." + std::to_string(i) + ".";
    m.push_back({w + "norm1.weight", {h + "input_layernorm.weight"}, Layout::Same, {{D}}});
    m.push_back(
        {w + "attention.q.weight", {h + "self_attn.q_proj.weight"}, Layout::Same, {{D, D}}});
    m.push_back({w + "attention.kv",
                 {h + "self_attn.k_proj.weight", h + "self_attn.v_proj.weight"},
                 Layout::Stacked,
                 {{KV, D}, {KV, D}}});
    m.push_back(
        {w + "attention.out.weight", {h + "self_attn.o_proj.weight"}, Layout::Same, {{D, D}}});
    m.push_back({w + "norm2.weight", {h + "post_attention_layernorm.weight"}, Layout::Same, {{D}}});
    m.push_back({w + "mlp.gate_up",
                 {h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"},
                 Layout::Stacked,
                 {{F, D}, {F, D}}});
    m.push_back({w + "mlp.down.weight", {h + "mlp.down_proj.weight"}, Layout::Same, {{D, F}}});
  }
  m.push_back({"norm.weight", {"model.norm.weight"}, Layout::Same, {{D}}});
  if (!c.tie_embeddings)
    m.push_back({"head.weight", {"lm_head.weight"}, Layout::Same, {{c.vocab, D}}});
  return m;
}

std::vector<Mapping> mappings(const ModelConfig& config) {
  return config.architecture == Architecture::GPT2 ? gpt2_mappings(config) : llama_mappings(config);
}

// The checkpoint's files: model.safetensors, or the shards its index names (headers read once).
class Checkpoint {
 public:
  explicit Checkpoint(const std::string& dir) : dir_(dir) {
    const std::string index = dir + "/model.safetensors.index.json";
    if (!fs::exists(index)) {
      WEAVE_CHECK(fs::exists(dir + "/model.safetensors"), kHf,
                  "{} has neither model.safetensors nor model.safetensors.index.json", dir);
      for (const auto& e : header("model.safetensors").entries)
        file_of_[e.name] = "model.safetensors";
      return;
    }
    try {
      const json parsed = json::parse(read_file(index));
      for (const auto& [name, file] : parsed.at("weight_map").items())
        file_of_[name] = file.get<std::string>();
    } catch (const json::exception& e) {
      WEAVE_FAIL(kHf, "{} is not a safetensors index: {}", index, e.what());
    }
    for (const auto& [name, file] : file_of_)
      WEAVE_CHECK(fs::exists(dir + "/" + file), kHf, "shard {} (holding {} in {}) is missing",
                  dir + "/" + file, name, index);
  }

  // The entry of `name` (GPT-2's files may lack the "transformer." prefix).
  std::pair<const SafetensorsHeader*, const SafetensorsEntry*> find(const std::string& name) {
    std::string key = name;
    if (!file_of_.count(key) && key.starts_with("transformer.")) key = key.substr(12);
    const auto file = file_of_.find(key);
    WEAVE_CHECK(file != file_of_.end(), kHf, "{} lacks tensor {}, which the config's model needs",
                dir_, name);
    const SafetensorsHeader& h = header(file->second);
    for (const auto& e : h.entries)
      if (e.name == key) return {&h, &e};
    WEAVE_FAIL(kHf, "{}/{} lacks tensor {}, which its index places there", dir_, file->second, key);
  }

 private:
  const SafetensorsHeader& header(const std::string& file) {
    auto& slot = headers_[file];
    if (!slot.path.empty()) return slot;
    slot = read_safetensors_header(dir_ + "/" + file);
    return slot;
  }
  std::string dir_;
  std::map<std::string, std::string> file_of_;
  std::map<std::string, SafetensorsHeader> headers_;
};

// Rows [r0, r1) and columns [c0, c1) of a source (a vector read as one row), in its own dtype.
struct Reader {
  Checkpoint& checkpoint;
  int64_t bytes = 0;

  Tensor box(const std::string& name, const Shape& expected, int64_t r0, int64_t r1, int64_t c0,
             int64_t c1) {
    const auto [header, entry] = checkpoint.find(name);
    WEAVE_CHECK(entry->shape == expected, kHf,
                "tensor {} in {} has shape {}, but the config's model needs {}", name, header->path,
                entry->shape, expected);
    WEAVE_CHECK(entry->dtype == kFloat32 || entry->dtype == kBFloat16 || entry->dtype == kFloat16 ||
                    entry->dtype == kFloat64,
                kHf, "tensor {} in {} is {}, not floating point", name, header->path, entry->dtype);
    const int64_t cols = expected.size() == 2 ? expected[1] : expected[0];
    const auto size = int64_t(itemsize(entry->dtype));
    Tensor out = empty({r1 - r0, c1 - c0}, {.dtype = entry->dtype});
    auto* dest = static_cast<unsigned char*>(out.data_ptr());
    std::vector<ByteRange> ranges;
    for (int64_t r = r0; r < r1; ++r) {
      const uint64_t begin = entry->begin + uint64_t((r * cols + c0) * size);
      ranges.push_back({begin, begin + uint64_t((c1 - c0) * size), dest});
      dest += (c1 - c0) * size;
    }
    bytes += int64_t(read_safetensors_ranges(*header, std::move(ranges)));
    return out;
  }
};

// The slice [begin, end) along axis of W (axis -1: all of W), from the sources.
Tensor read_slice(Reader& reader, const Mapping& m, const Slice& s, const ModelConfig& c) {
  const Shape& shape = m.shapes[0];
  const bool matrix = shape.size() == 2;
  const int64_t rows = matrix ? shape[0] : 1, cols = matrix ? shape[1] : shape[0];
  const auto whole = [&](const std::string& name) {
    return reader.box(name, shape, 0, rows, 0, cols);
  };
  switch (m.layout) {
    case Layout::Same: {
      if (s.axis < 0) return whole(m.sources[0]).reshape(shape);
      if (!matrix || s.axis == 1)  // columns
        return reader.box(m.sources[0], shape, 0, rows, s.begin, s.end)
            .reshape(matrix ? Shape{rows, s.end - s.begin} : Shape{s.end - s.begin});
      return reader.box(m.sources[0], shape, s.begin, s.end, 0, cols);
    }
    case Layout::Transposed: {  // W rows are S columns
      if (s.axis < 0) return whole(m.sources[0]).t();
      if (s.axis == 0) return reader.box(m.sources[0], shape, 0, rows, s.begin, s.end).t();
      return reader.box(m.sources[0], shape, s.begin, s.end, 0, cols).t();
    }
    case Layout::Stacked: {
      std::vector<Tensor> parts;
      for (size_t k = 0; k < m.sources.size(); ++k) {
        if (s.axis == 0 && (int64_t(k) < s.begin || int64_t(k) >= s.end)) continue;
        const Mapping part{m.weave, {m.sources[k]}, Layout::Same, {m.shapes[k]}};
        parts.push_back(
            read_slice(reader, part, s.axis > 0 ? Slice{s.axis - 1, s.begin, s.end} : Slice{}, c));
      }
      return stack(parts);
    }
    case Layout::HeadsQKV: {
      const int64_t D = c.dim, head_dim = c.dim / c.heads, per_head = 3 * head_dim;
      int64_t h0 = 0, h1 = c.heads;
      if (s.axis == 0 && s.begin % per_head == 0 && s.end % per_head == 0)
        h0 = s.begin / per_head, h1 = s.end / per_head;
      else if (s.axis >= 0)  // no head-aligned slice: the whole, then the slice
        return read_slice(reader, m, {}, c).narrow(s.axis, s.begin, s.end - s.begin);
      std::vector<Tensor> qkv;  // each [rows of S, (h1 - h0) head_dim]
      for (int64_t part = 0; part < 3; ++part)
        qkv.push_back(reader.box(m.sources[0], shape, 0, rows, part * D + h0 * head_dim,
                                 part * D + h1 * head_dim));
      if (!matrix)  // [1, n] each -> [heads, 3, head_dim] -> flat
        return stack({qkv[0].reshape({h1 - h0, head_dim}), qkv[1].reshape({h1 - h0, head_dim}),
                      qkv[2].reshape({h1 - h0, head_dim})},
                     1)
            .reshape({(h1 - h0) * per_head});
      std::vector<Tensor> heads;
      for (auto& t : qkv) heads.push_back(t.t().reshape({h1 - h0, head_dim, rows}));
      return stack(heads, 1).reshape({(h1 - h0) * per_head, rows});
    }
  }
  WEAVE_FAIL(kHf, "unknown layout");
}

}  // namespace

LoadStats load_weights(nn::Module& model, const ModelConfig& config, const std::string& dir,
                       const SliceOf& slice_of) {
  Checkpoint checkpoint(dir);
  Reader reader{checkpoint};
  std::map<std::string, const Mapping*> by_name;
  const std::vector<Mapping> all = mappings(config);
  for (const auto& m : all) by_name[m.weave] = &m;
  NoGradGuard no_grad;
  LoadStats stats;
  for (auto& [name, param] : model.named_parameters()) {
    const auto found = by_name.find(name);
    WEAVE_CHECK(found != by_name.end(), kHf,
                "the model's parameter {} has no counterpart in a {} checkpoint; hint: load into "
                "the model data::hf::make_model builds (or one split from it)",
                name, config.architecture == Architecture::GPT2 ? "GPT-2" : "Llama");
    const Slice slice = slice_of ? slice_of(name, param) : Slice{};
    Tensor value = read_slice(reader, *found->second, slice, config);
    WEAVE_CHECK(value.shape() == param.shape(), kHf,
                "{} reads as {} from {} but the parameter is {}; hint: is the model built for "
                "this config?",
                name, value.shape(), dir, param.shape());
    param.copy_(value.to(param.dtype()).to(param.device()));
    ++stats.tensors;
  }
  stats.bytes_read = reader.bytes;
  return stats;
}

namespace {

// The Hugging Face tensors of one weave tensor W (whole), in config.dtype.
std::vector<std::pair<std::string, Tensor>> to_sources(const Mapping& m, const Tensor& w,
                                                       const ModelConfig& c) {
  const Tensor cpu = w.to(kCPU).to(c.dtype);
  switch (m.layout) {
    case Layout::Same:
      return {{m.sources[0], cpu.contiguous()}};
    case Layout::Transposed:
      return {{m.sources[0], cpu.t().contiguous()}};
    case Layout::Stacked:
      return {{m.sources[0], cpu.select(0, 0).contiguous()},
              {m.sources[1], cpu.select(0, 1).contiguous()}};
    case Layout::HeadsQKV: {
      const int64_t head_dim = c.dim / c.heads;
      if (cpu.dim() == 1)
        return {{m.sources[0], cpu.reshape({c.heads, 3, head_dim})
                                   .transpose(0, 1)
                                   .contiguous()
                                   .reshape({3 * c.dim})}};
      return {{m.sources[0], cpu.reshape({c.heads, 3, head_dim, c.dim})
                                 .transpose(0, 1)
                                 .contiguous()
                                 .reshape({3 * c.dim, c.dim})
                                 .t()
                                 .contiguous()}};
    }
  }
  WEAVE_FAIL(kHf, "unknown layout");
}

}  // namespace

void save_pretrained(const nn::Module& model, const ModelConfig& config, const std::string& dir,
                     const SaveOptions& options) {
  std::map<std::string, Tensor> params;
  for (const auto& [name, p] : model.named_parameters()) params[name] = p;
  std::vector<std::vector<std::pair<std::string, Tensor>>> shards(1);
  uint64_t shard_bytes = 0;
  for (const Mapping& m : mappings(config)) {
    const auto found = params.find(m.weave);
    WEAVE_CHECK(found != params.end(), kHf,
                "the model has no parameter {}, which a {} checkpoint holds; hint: save the whole "
                "model (gather a split one's state first)",
                m.weave, config.architecture == Architecture::GPT2 ? "GPT-2" : "Llama");
    for (auto& [name, t] : to_sources(m, found->second, config)) {
      const uint64_t bytes = uint64_t(t.numel()) * itemsize(t.dtype());
      if (shard_bytes > 0 && shard_bytes + bytes > options.max_shard_bytes)
        shards.emplace_back(), shard_bytes = 0;
      shards.back().emplace_back(name, t);
      shard_bytes += bytes;
    }
  }
  fs::create_directories(dir);
  const Metadata metadata{{"format", "pt"}};
  json weight_map = json::object();
  uint64_t total = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string file = shards.size() == 1 ? "model.safetensors"
                                                : fmt::format("model-{:05d}-of-{:05d}.safetensors",
                                                              i + 1, shards.size());
    save_safetensors(dir + "/" + file, shards[i], metadata);
    for (const auto& [name, t] : shards[i]) {
      weight_map[name] = file;
      total += uint64_t(t.numel()) * itemsize(t.dtype());
    }
  }
  if (shards.size() > 1)
    write_file_atomically(
        dir + "/model.safetensors.index.json",
        json{{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}}.dump(2));
  write_file_atomically(dir + "/config.json", config_json(config));
}

}  // namespace weave::data::hf
