// The reads that convert Hugging Face's layouts to weave's, slice by slice; each architecture's
// names and layouts come from weave/models/<arch>/ (hf_architecture.h).
#include "weave/data/hf/hf_checkpoint.h"

#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "weave/autograd/grad_mode.h"
#include "weave/data/hf/hf_architecture.h"
#include "weave/data/hf/hf_mapping.h"
#include "weave/data/safetensors.h"
#include "weave/nn/deferred.h"

namespace weave::data::hf {
namespace detail {
std::vector<Mapping> mappings(const ModelConfig& config) {
  return architecture(config.architecture).mappings(config);
}

// W's shape: what weave holds of the sources.
Shape weave_shape(const Mapping& m) {
  const Shape& s = m.shapes[0];
  if (m.layout == Layout::Stacked) {
    Shape out = s;
    out.insert(0, int64_t(m.sources.size()));
    return out;
  }
  if (m.layout == Layout::Same || s.size() == 1) return s;
  return {s[1], s[0]};  // Transposed, HeadsQKV
}

}  // namespace detail

using namespace detail;

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;
constexpr const char* kHf = "hf";

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

Shape sliced(Shape shape, const Slice& s) {
  if (s.axis >= 0) shape[s.axis] = s.end - s.begin;
  return shape;
}

// Rows [r0, r1) of the slice s of W, a matrix (of a vector: its elements [r0, r1)).
Tensor read_rows(Reader& reader, const Mapping& m, const Slice& s, int64_t r0, int64_t r1,
                 const ModelConfig& c) {
  const Shape& shape = m.shapes[0];
  const std::string& source = m.sources[0];
  const bool matrix = shape.size() == 2;
  // W's box: rows [a0, a1) (a vector's elements), columns [b0, b1).
  int64_t a0 = r0, a1 = r1, b0 = 0, b1 = matrix ? weave_shape(m)[1] : 1;
  if (s.axis == 0) a0 += s.begin, a1 += s.begin;
  if (s.axis == 1) b0 = s.begin, b1 = s.end;
  switch (m.layout) {
    case Layout::Same:
      if (!matrix) return reader.box(source, shape, 0, 1, a0, a1).reshape({a1 - a0});
      return reader.box(source, shape, a0, a1, b0, b1);
    case Layout::Transposed:  // W rows are S columns
      return reader.box(source, shape, b0, b1, a0, a1).t();
    case Layout::HeadsQKV: {  // the heads that hold the rows, then the rows
      const int64_t D = c.dim, head_dim = c.dim / c.heads, per_head = 3 * head_dim;
      const int64_t h0 = a0 / per_head, h1 = (a1 + per_head - 1) / per_head, n = h1 - h0;
      std::vector<Tensor> parts;  // q, k and v: [n, head_dim, W's columns]
      for (int64_t part = 0; part < 3; ++part) {
        Tensor t = reader.box(source, shape, matrix ? b0 : 0, matrix ? b1 : 1,
                              part * D + h0 * head_dim, part * D + h1 * head_dim);
        parts.push_back(t.t().reshape({n, head_dim, b1 - b0}));
      }
      Tensor heads = stack(parts, 1).reshape({n * per_head, b1 - b0});
      heads = heads.narrow(0, a0 - h0 * per_head, a1 - a0);
      return matrix ? heads : heads.reshape({a1 - a0});
    }
    case Layout::Stacked:
      break;
  }
  WEAVE_FAIL(kHf, "read_rows takes a single source");
}

// Elements [first, first + count) of the slice s of W, flat: only the rows holding them are read.
Tensor read_range(Reader& reader, const Mapping& m, const Slice& s, int64_t first, int64_t count,
                  const ModelConfig& c) {
  if (m.layout == Layout::Stacked) {  // part by part, each a Same source
    const bool picks = s.axis == 0;
    const Slice inner = s.axis > 0 ? Slice{s.axis - 1, s.begin, s.end} : Slice{};
    std::vector<Tensor> out;
    int64_t at = 0;  // where part k starts among the slice's elements
    for (int64_t k = picks ? s.begin : 0; k < (picks ? s.end : int64_t(m.sources.size())); ++k) {
      const Mapping part{m.weave, {m.sources[size_t(k)]}, Layout::Same, {m.shapes[size_t(k)]}};
      const int64_t size = sliced(m.shapes[size_t(k)], inner).numel();
      const int64_t lo = std::max(first, at), hi = std::min(first + count, at + size);
      if (lo < hi) out.push_back(read_range(reader, part, inner, lo - at, hi - lo, c));
      at += size;
    }
    return out.size() == 1 ? out[0] : cat(out);
  }
  const Shape shape = sliced(weave_shape(m), s);
  const int64_t row = shape.numel() / shape[0];
  const int64_t r0 = first / row, r1 = (first + count + row - 1) / row;
  return read_rows(reader, m, s, r0, r1, c)
      .contiguous()
      .reshape({(r1 - r0) * row})
      .narrow(0, first - r0 * row, count);
}

}  // namespace

struct WeightReader::Impl {
  ModelConfig config;
  std::string dir;
  Checkpoint checkpoint;
  Reader reader{checkpoint};
  std::vector<Mapping> all = mappings(config);
  std::map<std::string, const Mapping*> by_name;

  Impl(ModelConfig config_in, std::string dir_in)
      : config(std::move(config_in)), dir(std::move(dir_in)), checkpoint(dir) {
    for (const auto& m : all) by_name[m.weave] = &m;
  }
  const Mapping& mapping(const std::string& name) const {
    const auto found = by_name.find(name);
    WEAVE_CHECK(found != by_name.end(), kHf,
                "the model's parameter {} has no counterpart in a {} checkpoint; hint: load into "
                "the model models::make_model builds (whole or split)",
                name, architecture(config.architecture).display);
    return *found->second;
  }
};

WeightReader::WeightReader(ModelConfig config, std::string dir)
    : impl_(std::make_unique<Impl>(std::move(config), std::move(dir))) {}
WeightReader::~WeightReader() = default;

Shape WeightReader::shape(const std::string& name) const {
  return weave_shape(impl_->mapping(name));
}

Tensor WeightReader::read(const std::string& name, const Slice& slice) {
  const Shape whole = sliced(shape(name), slice);
  return read_elements(name, slice, 0, whole.numel()).reshape(whole);
}

Tensor WeightReader::read_elements(const std::string& name, const Slice& slice, int64_t first,
                                   int64_t count) {
  const Mapping& m = impl_->mapping(name);
  const Shape whole = weave_shape(m);
  WEAVE_CHECK(slice.axis < whole.size() &&
                  (slice.axis < 0 ||
                   (0 <= slice.begin && slice.begin < slice.end && slice.end <= whole[slice.axis])),
              kHf, "{} is {}: it has no slice [{}, {}) along axis {}", name, whole, slice.begin,
              slice.end, slice.axis);
  const int64_t size = sliced(whole, slice).numel();
  WEAVE_CHECK(0 <= first && 0 < count && first + count <= size, kHf,
              "{}'s slice has {} elements: it has no elements [{}, {})", name, size, first,
              first + count);
  return read_range(impl_->reader, m, slice, first, count, impl_->config);
}

int64_t WeightReader::bytes_read() const {
  return impl_->reader.bytes;
}

LoadStats load_weights(nn::Module& model, const ModelConfig& config, const std::string& dir) {
  WeightReader reader(config, dir);
  NoGradGuard no_grad;
  LoadStats stats;
  for (auto& [name, param] : model.named_parameters()) {
    Tensor value = reader.read(name);
    WEAVE_CHECK(value.shape() == param.shape(), kHf,
                "{} reads as {} from {} but the parameter is {}; hint: is the model built for "
                "this config?",
                name, value.shape(), dir, param.shape());
    nn::materialize_for_overwrite(param);  // a deferred model: the file's values, nothing drawn
    param.copy_(value.to(param.dtype()).to(param.device()));
    ++stats.tensors;
  }
  stats.bytes_read = reader.bytes_read();
  return stats;
}

}  // namespace weave::data::hf
