// The reads that convert Hugging Face's layouts to weave's, slice by slice; each architecture's
// names and layouts come from weave/models/<arch>/ (hf_architecture.h).
#include "weave/data/hf/hf_checkpoint.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "weave/autograd/grad_mode.h"
#include "weave/data/files.h"
#include "weave/data/hf/hf_architecture.h"
#include "weave/data/hf/hf_mapping.h"
#include "weave/data/safetensors.h"
#include "weave/nn/deferred.h"
#include "weave/tensor/checksum.h"

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

namespace {

// Whether `path` lies in folder `root` (both canonical).
bool lies_in(const std::filesystem::path& path, const std::filesystem::path& root) {
  const auto [stop, unused] = std::mismatch(root.begin(), root.end(), path.begin(), path.end());
  return stop == root.end();
}

}  // namespace

std::string checkpoint_file(const std::string& dir, const std::string& entry) {
  namespace fs = std::filesystem;
  const fs::path name(entry);
  bool relative = !entry.empty() && name.is_relative() && !name.has_root_name();
  for (const fs::path& part : name) relative = relative && part != "..";
  WEAVE_CHECK(relative, "hf",
              "{} names '{}', a path outside the directory; hint: a checkpoint names its files "
              "relative to its directory, without '..'",
              dir, entry);
  const fs::path path = fs::path(dir) / name;
  std::error_code error;
  if (!fs::exists(fs::symlink_status(path, error))) return path.string();
  const fs::path real = fs::canonical(path, error);
  WEAVE_CHECK(!error, "hf", "{} names '{}', which does not resolve: {}", dir, entry,
              error.message());
  const fs::path root = fs::canonical(dir);
  // Hugging Face's cache: <cache>/snapshots/<revision>/<file> links to <cache>/blobs/<hash>.
  const bool snapshot = root.parent_path().filename() == "snapshots";
  const bool inside = lies_in(real, root) ||
                      (snapshot && lies_in(real, root.parent_path().parent_path() / "blobs"));
  WEAVE_CHECK(inside, "hf",
              "{} names '{}', which leads to {}, outside the directory; hint: a checkpoint's "
              "files lie in its directory (links only into a Hugging Face cache's blobs/)",
              dir, entry, real.string());
  WEAVE_CHECK(fs::is_regular_file(real, error), "hf",
              "{} names '{}', which is no regular file ({}); hint: a checkpoint's files are "
              "plain files",
              dir, entry, real.string());
  return real.string();
}

}  // namespace detail

using namespace detail;

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;
constexpr const char* kHf = "hf";

// "a, b, c, d, ... (n in all)": the first few names of a list.
std::string some_of(const std::vector<std::string>& names) {
  std::string text;
  for (size_t i = 0; i < names.size() && i < 4; ++i) text += (i ? ", " : "") + names[i];
  if (names.size() > 4) text += fmt::format(", ... ({} in all)", names.size());
  return text;
}

// The checkpoint's files: model.safetensors, or the shards its index names (headers read once),
// each resolved inside the directory.
class Checkpoint {
 public:
  explicit Checkpoint(const std::string& dir) : dir_(dir) {
    const std::string index = checkpoint_file(dir, "model.safetensors.index.json");
    const std::string single = checkpoint_file(dir, "model.safetensors");
    const bool indexed = fs::exists(index), whole = fs::exists(single);
    WEAVE_CHECK(indexed || whole, kHf,
                "{} has neither model.safetensors nor model.safetensors.index.json", dir);
    WEAVE_CHECK(!indexed || !whole, kHf,
                "{} holds both model.safetensors and model.safetensors.index.json: two exports, "
                "and loaders differ on which they take; hint: remove the stale one (weave's "
                "exports replace both as one unit)",
                dir);
    if (whole) {
      path_of_["model.safetensors"] = single;
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
    for (const auto& [name, file] : file_of_) {
      if (path_of_.count(file)) continue;
      const std::string path = checkpoint_file(dir, file);
      WEAVE_CHECK(fs::exists(path), kHf, "shard {} (holding {} in {}) is missing", path, name,
                  index);
      path_of_[file] = path;
    }
  }

  // The checkpoint's name of `name` (GPT-2's files may lack the "transformer." prefix); empty
  // when it holds neither.
  std::string key_of(const std::string& name) const {
    if (file_of_.count(name)) return name;
    if (name.starts_with("transformer.") && file_of_.count(name.substr(12))) return name.substr(12);
    return "";
  }

  // Raises for tensors the config's model needs that the files lack, and for tensors they hold
  // that it does not use (unless allowed: then they are returned).
  std::vector<std::string> account(const std::vector<Mapping>& all, const ModelConfig& config,
                                   bool allow_unused) const {
    std::set<std::string> read;
    std::vector<std::string> missing, unused;
    for (const Mapping& m : all)
      for (const std::string& source : m.sources) {
        const std::string key = key_of(source);
        if (key.empty()) missing.push_back(source);
        read.insert(key);
      }
    WEAVE_CHECK(missing.empty(), kHf, "{} lacks {} tensor(s) the config's model needs: {}", dir_,
                missing.size(), some_of(missing));
    const ArchitectureSpec& spec = architecture(config.architecture);
    for (const auto& [name, file] : file_of_)
      if (!read.count(name) && !(spec.ignorable && spec.ignorable(name, config)))
        unused.push_back(name);
    WEAVE_CHECK(unused.empty() || allow_unused, kHf,
                "{} holds {} tensor(s) the config's model does not use: {}; hint: a config.json "
                "that matches the weights (layers, sizes, tie_word_embeddings), or "
                "LoadOptions{{.allow_unused = true}} to pass over them",
                dir_, unused.size(), some_of(unused));
    return unused;
  }

  // What tells this checkpoint from another of the same shapes, cheaply: per file its name,
  // size, and a CRC-32 of its header and of kSamples blocks spread over its data (a few hundred
  // KB read, whatever the model's size).
  std::string fingerprint() {
    constexpr uint64_t kSamples = 32, kBlock = 4096;
    std::string out;
    for (const auto& [file, path] : path_of_) {
      const SafetensorsHeader& h = header(file);
      const uint64_t size = fs::file_size(path), data = size - h.data_start;
      ReadOnlyFile in(path);
      std::string bytes(size_t(h.data_start), '\0');
      read_exactly_at(in.fd, bytes.data(), h.data_start, 0, path);
      const uint32_t head = checksum_bytes(bytes.data(), bytes.size());
      uint32_t sampled = 0;
      for (uint64_t k = 0; k < (data > kBlock ? kSamples : data > 0 ? 1 : 0); ++k) {
        const uint64_t at =
            h.data_start + (data > kBlock ? (data - kBlock) * k / (kSamples - 1) : 0);
        bytes.resize(size_t(std::min(kBlock, data)));
        read_exactly_at(in.fd, bytes.data(), bytes.size(), at, path);
        sampled ^= checksum_bytes(bytes.data(), bytes.size()) + uint32_t(k) * 0x9e3779b9u;
      }
      out += fmt::format("{} {} bytes, header {:08x}, data {:08x}\n", file, size, head, sampled);
    }
    return out;
  }

  // The entry of `name`.
  std::pair<const SafetensorsHeader*, const SafetensorsEntry*> find(const std::string& name) {
    const std::string key = key_of(name);
    WEAVE_CHECK(!key.empty(), kHf, "{} lacks tensor {}, which the config's model needs", dir_,
                name);
    const std::string& file = file_of_.at(key);
    const SafetensorsHeader& h = header(file);
    for (const auto& e : h.entries)
      if (e.name == key) return {&h, &e};
    WEAVE_FAIL(kHf, "{}/{} lacks tensor {}, which its index places there", dir_, file, key);
  }

 private:
  const SafetensorsHeader& header(const std::string& file) {
    auto& slot = headers_[file];
    if (!slot.path.empty()) return slot;
    slot = read_safetensors_header(path_of_.at(file));
    return slot;
  }
  std::string dir_;
  std::map<std::string, std::string> file_of_;  // tensor -> the index's file name
  std::map<std::string, std::string> path_of_;  // file name -> its resolved path
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

// Raises, naming the first element of `values` (elements first, first + 1, ... of the slice)
// that is not finite by its index in the whole tensor.
[[noreturn]] void fail_non_finite(const Mapping& m, const Tensor& values, const Shape& whole,
                                  const Slice& slice, int64_t first, const std::string& dir) {
  const std::vector<double> read = values.to(kFloat64).to_vector<double>();
  const auto bad =
      std::find_if(read.begin(), read.end(), [](double v) { return !std::isfinite(v); });
  const Shape shape = sliced(whole, slice);
  int64_t flat = first + (bad - read.begin());
  std::vector<int64_t> index(shape.size());
  for (int64_t axis = int64_t(shape.size()) - 1; axis >= 0; --axis) {
    index[size_t(axis)] = flat % shape[axis];
    flat /= shape[axis];
  }
  if (slice.axis >= 0) index[size_t(slice.axis)] += slice.begin;
  std::string sources;
  for (const std::string& source : m.sources) sources += (sources.empty() ? "" : ", ") + source;
  WEAVE_FAIL(kHf,
             "{} ({} in {}) holds {} at [{}]; hint: the checkpoint is damaged or its training "
             "diverged; LoadOptions{{.check_finite = false}} loads it anyway",
             m.weave, sources, dir, *bad, fmt::join(index, ", "));
}

}  // namespace

struct WeightReader::Impl {
  ModelConfig config;
  std::string dir;
  LoadOptions options;
  Checkpoint checkpoint;
  Reader reader{checkpoint};
  std::vector<Mapping> all = mappings(config);
  std::vector<std::string> unused = checkpoint.account(all, config, options.allow_unused);
  std::map<std::string, const Mapping*> by_name;

  Impl(ModelConfig config_in, std::string dir_in, LoadOptions options_in)
      : config(std::move(config_in)), dir(std::move(dir_in)), options(options_in), checkpoint(dir) {
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

WeightReader::WeightReader(ModelConfig config, std::string dir, LoadOptions options)
    : impl_(std::make_unique<Impl>(std::move(config), std::move(dir), options)) {}
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
  Tensor values = read_range(impl_->reader, m, slice, first, count, impl_->config);
  if (impl_->options.check_finite && !all_finite(values))
    fail_non_finite(m, values, whole, slice, first, impl_->dir);
  return values;
}

const std::vector<std::string>& WeightReader::unused() const {
  return impl_->unused;
}

std::string WeightReader::fingerprint() const {
  return impl_->checkpoint.fingerprint();
}

int64_t WeightReader::bytes_read() const {
  return impl_->reader.bytes;
}

LoadStats load_weights(nn::Module& model, const ModelConfig& config, const std::string& dir,
                       const LoadOptions& options) {
  WeightReader reader(config, dir, options);
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
  stats.unused = reader.unused();
  return stats;
}

}  // namespace weave::data::hf
