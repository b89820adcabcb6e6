#include "weave/data/safetensors.h"

#include <sys/stat.h>

#include <zlib.h>
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "weave/data/safetensors_json.h"
#include "weave/tensor/tensor_impl.h"

namespace weave::data {

namespace {

using json = nlohmann::json;

// The format caps the header at 100 MB; a larger length is a corrupt file, not an allocation.
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;
// Metadata keys of the checksums weave writes: one per tensor, one over the user metadata.
constexpr const char* kChecksumPrefix = "weave.crc32.";
constexpr const char* kMetadataChecksum = "weave.crc32/metadata";
// CRC-32 of every block of the data section ("<block bytes> <crc><crc>..."): a read of part of
// the file verifies just the blocks it touches.
constexpr const char* kBlockChecksums = "weave.crc32/blocks";
constexpr uint64_t kChecksumBlockBytes = uint64_t{64} << 10;

uint32_t crc32_of(const void* data, size_t size, uint32_t seed = 0) {
  return static_cast<uint32_t>(::crc32_z(seed, static_cast<const Bytef*>(data), size));
}

std::string hex32(uint32_t v) {
  return fmt::format("{:08x}", v);
}

// The value of hex32's text, if it is exactly such a text (8 lowercase hex digits): a flipped
// bit that turns a digit into its capital must not read as the same checksum.
bool parse_hex32(const std::string& text, uint32_t* out) {
  if (text.size() != 8) return false;
  uint32_t v = 0;
  for (char c : text) {
    const bool digit = c >= '0' && c <= '9', letter = c >= 'a' && c <= 'f';
    if (!digit && !letter) return false;
    v = v * 16 + uint32_t(digit ? c - '0' : c - 'a' + 10);
  }
  *out = v;
  return true;
}

// CRC-32 over the metadata (the tensors' checksums and its own excluded; the block checksums
// included), key and value, in key order.
uint32_t metadata_checksum(const std::map<std::string, std::string>& metadata) {
  uint32_t crc = 0;
  for (const auto& [key, value] : metadata) {
    if (key.rfind(kChecksumPrefix, 0) == 0 || key == kMetadataChecksum) continue;
    // With the terminating NUL: "ab" + "c" and "a" + "bc" differ.
    crc = crc32_of(key.data(), key.size() + 1, crc);
    crc = crc32_of(value.data(), value.size() + 1, crc);
  }
  return crc;
}

using Entry = SafetensorsEntry;

// The checksums weave stores, from one pass over the data in file order: each tensor's CRC-32
// and each block's. Each segment between tensor and block boundaries is checksummed once and
// combined into both.
class DataChecksums {
 public:
  // The next `size` bytes of the current tensor.
  void add(const void* data, uint64_t size) {
    const auto* bytes = static_cast<const char*>(data);
    while (size > 0) {
      const uint64_t take = std::min(size, kChecksumBlockBytes - in_block_);
      const uint32_t segment = crc32_of(bytes, take);
      tensor_crc_ = uint32_t(::crc32_combine(tensor_crc_, segment, z_off_t(take)));
      block_crc_ = uint32_t(::crc32_combine(block_crc_, segment, z_off_t(take)));
      bytes += take, size -= take, in_block_ += take;
      if (in_block_ == kChecksumBlockBytes) {
        blocks_ += hex32(block_crc_);
        block_crc_ = 0, in_block_ = 0;
      }
    }
  }
  // Ends the current tensor: its checksum, stored under its name.
  void end_tensor(const std::string& name, Metadata& stored) {
    stored[kChecksumPrefix + name] = hex32(tensor_crc_);
    tensor_crc_ = 0;
  }
  // After the last tensor: the block checksums and the metadata's own.
  void finish(Metadata& stored) {
    if (in_block_ > 0) blocks_ += hex32(block_crc_);
    stored[kBlockChecksums] = blocks_;
    stored[kMetadataChecksum] = hex32(metadata_checksum(stored));
  }

 private:
  uint32_t tensor_crc_ = 0, block_crc_ = 0;
  uint64_t in_block_ = 0;
  std::string blocks_ = std::to_string(kChecksumBlockBytes) + " ";
};

// The user's metadata, checked: weave's checksum keys are reserved.
Metadata user_metadata(const Metadata& metadata) {
  for (const auto& [key, value] : metadata)
    WEAVE_CHECK(key.rfind("weave.crc32", 0) != 0, "safetensors",
                "metadata key '{}' is reserved (weave's checksums)", key);
  return metadata;
}

// The tensors' header entries, laid out in order; returns the data's size.
uint64_t add_entries(json& header, const std::vector<SafetensorsSpec>& specs) {
  uint64_t offset = 0;
  for (const SafetensorsSpec& spec : specs) {
    WEAVE_CHECK(!spec.name.empty() && spec.name != "__metadata__", "safetensors",
                "tensor name '{}' is reserved or empty", spec.name);
    WEAVE_CHECK(!header.contains(spec.name), "safetensors", "tensor name '{}' appears twice",
                spec.name);
    const uint64_t bytes = uint64_t(spec.shape.numel()) * itemsize(spec.dtype);
    header[spec.name] = {{"dtype", detail::format_dtype(spec.dtype)},
                         {"shape", spec.shape.vec()},
                         {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  return offset;
}

// The file's first bytes: the header's length, then the header with `stored` as its metadata,
// padded to the format's recommended 8-byte alignment.
std::string header_bytes(json header, const Metadata& stored) {
  header["__metadata__"] = stored;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  const uint64_t length = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  return out + text;
}

}  // namespace

std::string serialize_safetensors(const nn::NamedTensors& tensors, const Metadata& metadata) {
  Metadata stored = user_metadata(metadata);
  std::vector<SafetensorsSpec> specs;
  std::vector<Tensor> data;
  for (const auto& [name, t] : tensors) {
    WEAVE_CHECK(t.defined(), "safetensors", "tensor '{}' is undefined", name);
    data.push_back(t.detach().cpu().contiguous());
    specs.push_back({name, t.dtype(), t.shape()});
  }
  json header = json::object();
  const uint64_t size = add_entries(header, specs);
  DataChecksums checksums;
  for (size_t k = 0; k < data.size(); ++k) {
    checksums.add(data[k].data_ptr(), uint64_t(data[k].numel()) * data[k].itemsize());
    checksums.end_tensor(specs[k].name, stored);
  }
  checksums.finish(stored);
  std::string out = header_bytes(std::move(header), stored);
  out.reserve(out.size() + size);
  for (const Tensor& t : data)
    out.append(static_cast<const char*>(t.data_ptr()), uint64_t(t.numel()) * t.itemsize());
  return out;
}

struct SafetensorsWriter::Impl {
  AtomicFileWriter file;
  std::vector<SafetensorsSpec> specs;
  json header = json::object();
  Metadata stored;
  DataChecksums checksums;
  size_t next = 0;
  uint64_t header_size = 0;

  Impl(const std::string& path, std::vector<SafetensorsSpec> tensors, const Metadata& metadata)
      : file(path), specs(std::move(tensors)), stored(user_metadata(metadata)) {
    const uint64_t size = add_entries(header, specs);
    // Checksums of a fixed width: the header written now, with placeholders, is as long as the
    // one commit() writes over it.
    Metadata placeholder = stored;
    for (const SafetensorsSpec& spec : specs) placeholder[kChecksumPrefix + spec.name] = hex32(0);
    const uint64_t blocks = (size + kChecksumBlockBytes - 1) / kChecksumBlockBytes;
    placeholder[kBlockChecksums] =
        std::to_string(kChecksumBlockBytes) + " " + std::string(blocks * 8, '0');
    placeholder[kMetadataChecksum] = hex32(0);
    const std::string bytes = header_bytes(header, placeholder);
    header_size = bytes.size();
    file.write(bytes.data(), bytes.size());
  }
};

SafetensorsWriter::SafetensorsWriter(const std::string& path, std::vector<SafetensorsSpec> tensors,
                                     const Metadata& metadata)
    : impl_(std::make_unique<Impl>(path, std::move(tensors), metadata)) {}

SafetensorsWriter::~SafetensorsWriter() = default;

void SafetensorsWriter::write(const Tensor& values) {
  Impl& w = *impl_;
  WEAVE_CHECK(w.next < w.specs.size(), "safetensors", "all {} tensors are written already",
              w.specs.size());
  const SafetensorsSpec& spec = w.specs[w.next];
  WEAVE_CHECK(values.defined() && values.numel() == spec.shape.numel(), "safetensors",
              "tensor '{}' is {} ({} elements), but {} was declared", spec.name,
              values.defined() ? values.shape().str() : "undefined",
              values.defined() ? values.numel() : 0, spec.shape);
  const auto append = [&w](const Tensor& host) {
    const uint64_t bytes = uint64_t(host.numel()) * host.itemsize();
    w.checksums.add(host.data_ptr(), bytes);
    w.file.write(host.data_ptr(), bytes);
  };
  if (values.numel() > 0 && values.device().is_cpu() && values.dtype() == spec.dtype &&
      values.is_contiguous()) {
    append(values);
  } else if (values.numel() > 0) {  // a piece of rows at a time, copied and converted
    constexpr uint64_t kPieceBytes = uint64_t{16} << 20;
    const Tensor rows = values.dim() == 0 ? values.reshape({1}) : values;
    const int64_t n = rows.size(0), per_row = rows.numel() / n;
    const uint64_t row_bytes =
        uint64_t(per_row) * std::max(itemsize(spec.dtype), itemsize(values.dtype()));
    const int64_t step =
        std::max<int64_t>(1, int64_t(kPieceBytes / std::max<uint64_t>(1, row_bytes)));
    for (int64_t r = 0; r < n; r += step)
      append(rows.narrow(0, r, std::min(step, n - r)).to(kCPU).to(spec.dtype).contiguous());
  }
  w.checksums.end_tensor(spec.name, w.stored);
  ++w.next;
}

void SafetensorsWriter::commit() {
  Impl& w = *impl_;
  WEAVE_CHECK(w.next == w.specs.size(), "safetensors",
              "{} of {} tensors were written; the next is '{}'", w.next, w.specs.size(),
              w.next < w.specs.size() ? w.specs[w.next].name : "");
  w.checksums.finish(w.stored);
  const std::string bytes = header_bytes(w.header, w.stored);
  WEAVE_CHECK(bytes.size() == w.header_size, "safetensors",
              "the header grew from {} to {} bytes while its tensors were written", w.header_size,
              bytes.size());
  w.file.write_at(bytes.data(), bytes.size(), 0);
  w.file.commit();
}

namespace {

// The data must be covered exactly: no overlaps, no holes, nothing after the last tensor.
void check_coverage(std::vector<Entry>& entries, uint64_t data_size, const std::string& name) {
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  uint64_t expected = 0;
  for (const Entry& e : entries) {
    WEAVE_CHECK(e.begin == expected, "safetensors",
                "{}: tensor '{}' starts at byte {} of the data, expected {} (the tensors must "
                "cover the data without overlaps or holes)",
                name, e.name, e.begin, expected);
    WEAVE_CHECK(e.end <= data_size, "safetensors",
                "{} is truncated: tensor '{}' ends at byte {} of the data, which holds {}", name,
                e.name, e.end, data_size);
    expected = e.end;
  }
  WEAVE_CHECK(expected == data_size, "safetensors",
              "{} holds {} bytes of data after its tensors end at {}: corrupt or truncated "
              "header",
              name, data_size - expected, expected);
}

// "<block bytes> <crc><crc>...": one CRC per block of the data, the last one possibly short.
void read_block_checksums(SafetensorsHeader& out, const std::string& text, uint64_t data_size,
                          const std::string& name) {
  const size_t space = text.find(' ');
  const std::string size_text = text.substr(0, space);
  const bool digits = !size_text.empty() && size_text.size() < 12 &&
                      std::all_of(size_text.begin(), size_text.end(), ::isdigit);
  const uint64_t block = digits ? std::stoull(size_text) : 0;
  const uint64_t count = block == 0 ? 0 : (data_size + block - 1) / block;
  bool fits = block > 0 && space != std::string::npos && text.size() - space - 1 == count * 8;
  for (uint64_t i = 0; fits && i < count; ++i) {
    uint32_t crc = 0;
    fits = parse_hex32(text.substr(space + 1 + i * 8, 8), &crc);
    out.block_checksums.push_back(crc);
  }
  WEAVE_CHECK(fits, "safetensors",
              "{}: the block checksums do not fit the data: the file is corrupt", name);
  out.block_bytes = block;
}

// Files weave wrote carry a CRC-32 of every tensor's bytes and of the user metadata: a flipped
// bit anywhere is an error, not a silently different model. (Files from other writers have none
// and load as they are.) Any key of weave's checksum namespace marks the file as checked, so a
// flipped bit in one of those keys cannot turn the checking off.
void read_checksums(SafetensorsHeader& out, uint64_t data_size, const std::string& name) {
  for (const auto& [key, value] : out.metadata)
    out.checked = out.checked || key.rfind("weave.crc32", 0) == 0;
  if (out.checked) {
    Metadata& meta = out.metadata;
    WEAVE_CHECK(meta.count(kMetadataChecksum) == 1, "safetensors",
                "{}: the metadata checksum is missing: the file is corrupt", name);
    WEAVE_CHECK(meta[kMetadataChecksum] == hex32(metadata_checksum(meta)), "safetensors",
                "{}: the metadata fails its checksum (stored {}, computed {}): the file is "
                "corrupt",
                name, meta[kMetadataChecksum], hex32(metadata_checksum(meta)));
    size_t checksums = 0;
    for (const auto& [key, value] : meta) checksums += key.rfind(kChecksumPrefix, 0) == 0;
    WEAVE_CHECK(checksums == out.entries.size(), "safetensors",
                "{}: {} tensors but {} checksums: the file is corrupt", name, out.entries.size(),
                checksums);
    for (const Entry& e : out.entries) {
      auto stored = meta.find(kChecksumPrefix + e.name);
      WEAVE_CHECK(stored != meta.end() && parse_hex32(stored->second, &out.checksums[e.name]),
                  "safetensors", "{}: tensor '{}' has no checksum: the file is corrupt", name,
                  e.name);
    }
    auto blocks = meta.find(kBlockChecksums);
    if (blocks != meta.end()) read_block_checksums(out, blocks->second, data_size, name);
  }
  std::erase_if(out.metadata,
                [](const auto& item) { return item.first.rfind("weave.crc32", 0) == 0; });
}

// The header of a file of `file_size` bytes whose first `available` bytes (at least the length
// and the header) are at p: every check that needs no tensor data. The checksums stay in
// `checksums` and `block_checksums`, out of the metadata.
SafetensorsHeader parse_header(const unsigned char* p, uint64_t available, uint64_t file_size,
                               const std::string& name) {
  WEAVE_CHECK(file_size >= 8 && available >= 8, "safetensors",
              "{} is truncated: {} bytes, not even the header length", name, file_size);
  uint64_t length = 0;
  for (int i = 0; i < 8; ++i) length |= uint64_t{p[i]} << (8 * i);
  WEAVE_CHECK(length <= kMaxHeaderBytes && length <= file_size - 8, "safetensors",
              "{} declares a {}-byte header, but the file holds {} bytes after the length{}", name,
              length, file_size - 8,
              length > kMaxHeaderBytes ? " (the format's limit is 100 MB)" : "");
  WEAVE_CHECK(available >= 8 + length, "safetensors", "{}: the header was not read whole", name);
  SafetensorsHeader out;
  out.path = name;
  out.data_start = 8 + length;
  detail::read_header_json(p + 8, length, name, out.entries, out.metadata);
  const uint64_t data_size = file_size - 8 - length;
  check_coverage(out.entries, data_size, name);
  read_checksums(out, data_size, name);
  return out;
}

}  // namespace

SafetensorsFile parse_safetensors(const void* bytes, size_t size, const std::string& name) {
  const auto* p = static_cast<const unsigned char*>(bytes);
  const SafetensorsHeader header = parse_header(p, size, size, name);
  const unsigned char* data = p + header.data_start;
  SafetensorsFile file;
  for (const Entry& e : header.entries) {
    if (header.checked) {
      const uint32_t actual = crc32_of(data + e.begin, e.end - e.begin);
      WEAVE_CHECK(header.checksums.at(e.name) == actual, "safetensors",
                  "{}: tensor '{}' fails its checksum (stored {}, computed {}): the file is "
                  "corrupt",
                  name, e.name, hex32(header.checksums.at(e.name)), hex32(actual));
    }
    Tensor t = empty(e.shape, {.dtype = e.dtype});
    if (e.end > e.begin) std::memcpy(t.data_ptr(), data + e.begin, e.end - e.begin);
    if (e.dtype == kBool)
      for (uint64_t i = e.begin; i < e.end; ++i)
        WEAVE_CHECK(data[i] <= 1, "safetensors", "{}: bool tensor '{}' holds the byte {}", name,
                    e.name, int(data[i]));
    file.tensors.emplace_back(e.name, t);
  }
  file.metadata = header.metadata;
  return file;
}

void save_safetensors(const std::string& path, const nn::NamedTensors& tensors,
                      const Metadata& metadata) {
  std::vector<SafetensorsSpec> specs;
  for (const auto& [name, t] : tensors) {
    WEAVE_CHECK(t.defined(), "safetensors", "tensor '{}' is undefined", name);
    specs.push_back({name, t.dtype(), t.shape()});
  }
  SafetensorsWriter out(path, std::move(specs), metadata);
  for (const auto& [name, t] : tensors) out.write(t.detach());
  out.commit();
}

SafetensorsFile load_safetensors(const std::string& path) {
  const std::string bytes = read_file(path);
  return parse_safetensors(bytes.data(), bytes.size(), path);
}

SafetensorsHeader read_safetensors_header(const std::string& path) {
  ReadOnlyFile file(path);
  struct stat info;
  if (::fstat(file.fd, &info) != 0) fail_io("stat", path);
  const uint64_t size = uint64_t(info.st_size);
  unsigned char prefix[8] = {};
  WEAVE_CHECK(size >= 8, "safetensors", "{} is truncated: {} bytes, not even the header length",
              path, size);
  read_exactly_at(file.fd, prefix, 8, 0, path);
  uint64_t length = 0;
  for (int i = 0; i < 8; ++i) length |= uint64_t{prefix[i]} << (8 * i);
  std::string bytes(reinterpret_cast<const char*>(prefix), 8);
  if (length <= kMaxHeaderBytes && length <= size - 8) {
    bytes.resize(8 + length);
    read_exactly_at(file.fd, bytes.data() + 8, length, 8, path);
  }
  SafetensorsHeader header =
      parse_header(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), size, path);
  header.bytes_read = bytes.size();
  return header;
}

uint64_t read_safetensors_ranges(const SafetensorsHeader& header, std::vector<ByteRange> ranges) {
  const std::string& path = header.path;
  WEAVE_CHECK(!header.checked || header.block_bytes > 0, "safetensors",
              "{} has no block checksums, so parts of it cannot be verified; hint: it was "
              "written by an older weave: load it whole",
              path);
  const uint64_t data_size = header.entries.empty() ? 0 : header.entries.back().end;
  for (const ByteRange& r : ranges)
    WEAVE_CHECK(r.begin <= r.end && r.end <= data_size, "safetensors",
                "{}: bytes [{}, {}) lie outside its {} bytes of data", path, r.begin, r.end,
                data_size);
  std::sort(ranges.begin(), ranges.end(),
            [](const ByteRange& a, const ByteRange& b) { return a.begin < b.begin; });
  // Each read covers whole checksum blocks (or exactly the range in an unchecked file);
  // ranges that share or touch blocks are read together.
  const uint64_t block = header.checked ? header.block_bytes : 1;
  ReadOnlyFile file(path);
  uint64_t bytes_read = 0;
  std::vector<char> buffer;
  for (size_t i = 0; i < ranges.size();) {
    if (ranges[i].begin == ranges[i].end) {
      ++i;
      continue;
    }
    const uint64_t start = ranges[i].begin / block * block;
    uint64_t stop = std::min(data_size, (ranges[i].end + block - 1) / block * block);
    size_t j = i + 1;
    while (j < ranges.size() && ranges[j].begin / block * block <= stop) {
      stop = std::max(stop, std::min(data_size, (ranges[j].end + block - 1) / block * block));
      ++j;
    }
    // Read in pieces of at most 64 MB: the staging buffer stays bounded for big tensors.
    constexpr uint64_t kPiece = uint64_t{64} << 20;
    const uint64_t piece = header.checked ? std::max(block, kPiece / block * block) : kPiece;
    for (uint64_t at = start; at < stop; at += piece) {
      const uint64_t end = std::min(stop, at + piece);
      buffer.resize(end - at);
      read_exactly_at(file.fd, buffer.data(), end - at, header.data_start + at, path);
      bytes_read += end - at;
      if (header.checked)
        for (uint64_t b = at; b < end; b += block) {
          const uint64_t n = std::min(block, end - b);
          const uint32_t actual = crc32_of(buffer.data() + (b - at), n);
          const uint32_t stored = header.block_checksums[b / block];
          WEAVE_CHECK(actual == stored, "safetensors",
                      "{}: data bytes [{}, {}) fail their checksum (stored {}, computed {}): the "
                      "file is corrupt",
                      path, b, b + n, hex32(stored), hex32(actual));
        }
      for (size_t k = i; k < j; ++k) {
        const uint64_t from = std::max(ranges[k].begin, at), to = std::min(ranges[k].end, end);
        if (from < to)
          std::memcpy(static_cast<char*>(ranges[k].dest) + (from - ranges[k].begin),
                      buffer.data() + (from - at), to - from);
      }
    }
    i = j;
  }
  return bytes_read;
}

}  // namespace weave::data
