#include "weave/data/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <zlib.h>
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "weave/tensor/tensor_impl.h"

namespace weave::data {

namespace {

using json = nlohmann::json;

// The format caps the header at 100 MB; a larger length is a corrupt file, not an allocation.
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;
// A safetensors header is an object of objects holding short arrays: no more nesting, no
// longer arrays, and at most this many entries, or the file is crafted; checked on the raw
// bytes before the JSON parser allocates anything.
constexpr int kMaxHeaderDepth = 3;
constexpr int64_t kMaxHeaderEntries = int64_t{1} << 20;
// Metadata keys of the checksums weave writes: one per tensor, one over the user metadata.
constexpr const char* kChecksumPrefix = "weave.crc32.";
constexpr const char* kMetadataChecksum = "weave.crc32/metadata";

uint32_t crc32_of(const void* data, size_t size, uint32_t seed = 0) {
  return static_cast<uint32_t>(::crc32_z(seed, static_cast<const Bytef*>(data), size));
}

std::string hex32(uint32_t v) {
  return fmt::format("{:08x}", v);
}

// CRC-32 over the user's metadata (the checksums excluded), key and value, in key order.
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

// Rejects a header whose nesting, array lengths or entry count no safetensors header has.
void check_header_layout(const unsigned char* p, uint64_t length, const std::string& name) {
  int depth = 0;
  int64_t counts[kMaxHeaderDepth + 1] = {};
  bool is_array[kMaxHeaderDepth + 1] = {};
  bool in_string = false, escaped = false;
  for (uint64_t i = 0; i < length; ++i) {
    const unsigned char c = p[i];
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      WEAVE_CHECK(depth < kMaxHeaderDepth, "safetensors",
                  "{}: the header nests deeper than {} levels at byte {}; a safetensors header "
                  "never does (corrupt or crafted file)",
                  name, kMaxHeaderDepth, i + 8);
      ++depth;
      counts[depth] = 0;
      is_array[depth] = c == '[';
    } else if (c == '}' || c == ']') {
      if (depth > 0) --depth;
    } else if (c == ',' && depth > 0) {
      const int64_t n = ++counts[depth];
      WEAVE_CHECK(!is_array[depth] || n < kMaxDims, "safetensors",
                  "{}: the header holds an array of more than {} elements at byte {} (corrupt "
                  "or crafted file)",
                  name, kMaxDims, i + 8);
      WEAVE_CHECK(n < kMaxHeaderEntries, "safetensors",
                  "{}: the header holds more than {} entries (corrupt or crafted file)", name,
                  kMaxHeaderEntries);
    }
  }
}

const char* format_dtype(DType dtype) {
  switch (dtype) {
    case kFloat32:
      return "F32";
    case kFloat64:
      return "F64";
    case kBFloat16:
      return "BF16";
    case kFloat16:
      return "F16";
    case kInt32:
      return "I32";
    case kInt64:
      return "I64";
    case kUInt8:
      return "U8";
    case kBool:
      return "BOOL";
  }
  return "?";
}

bool parse_dtype(const std::string& text, DType* out) {
  for (DType d : {kFloat32, kFloat64, kBFloat16, kFloat16, kInt32, kInt64, kUInt8, kBool})
    if (text == format_dtype(d)) {
      *out = d;
      return true;
    }
  return false;
}

[[noreturn]] void fail_io(const char* what, const std::string& path) {
  WEAVE_FAIL("safetensors", "cannot {} {}: {}", what, path, std::strerror(errno));
}

struct Entry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin, end;
};

Entry parse_entry(const std::string& key, const json& value, const std::string& name) {
  auto bad = [&](const std::string& why) {
    WEAVE_FAIL("safetensors", "{}: tensor '{}' has {}", name, key, why);
  };
  if (!value.is_object()) bad("a header entry that is not an object");
  Entry e{key, kFloat32, {}, 0, 0};
  auto dtype = value.find("dtype");
  if (dtype == value.end() || !dtype->is_string()) bad("no dtype");
  if (!parse_dtype(dtype->get<std::string>(), &e.dtype))
    bad(fmt::format("dtype '{}', which weave does not read (F32 F64 BF16 F16 I32 I64 U8 BOOL)",
                    dtype->get<std::string>()));
  auto shape = value.find("shape");
  if (shape == value.end() || !shape->is_array() || shape->size() > size_t(kMaxDims))
    bad(fmt::format("no shape of at most {} dimensions", kMaxDims));
  for (const json& d : *shape) {
    if (!d.is_number_unsigned() || d.get<uint64_t>() > uint64_t(INT64_MAX))
      bad("a size that is not a non-negative integer");
    e.shape.push_back(static_cast<int64_t>(d.get<uint64_t>()));
  }
  auto offsets = value.find("data_offsets");
  if (offsets == value.end() || !offsets->is_array() || offsets->size() != 2 ||
      !(*offsets)[0].is_number_unsigned() || !(*offsets)[1].is_number_unsigned())
    bad("no data_offsets [begin, end]");
  e.begin = (*offsets)[0].get<uint64_t>();
  e.end = (*offsets)[1].get<uint64_t>();
  if (e.begin > e.end) bad(fmt::format("data_offsets [{}, {}] that run backwards", e.begin, e.end));
  int64_t bytes = 0;
  try {
    bytes = checked_byte_count(e.shape, e.dtype, "safetensors");
  } catch (const Error&) {
    bad(fmt::format("shape {}, whose byte count overflows", e.shape));
  }
  if (e.end - e.begin != uint64_t(bytes))
    bad(fmt::format("{} bytes in data_offsets [{}, {}], but {} {} needs {}", e.end - e.begin,
                    e.begin, e.end, format_dtype(e.dtype), e.shape, bytes));
  return e;
}

}  // namespace

std::string serialize_safetensors(const nn::NamedTensors& tensors, const Metadata& metadata) {
  json header = json::object();
  std::map<std::string, std::string> stored(metadata.begin(), metadata.end());
  for (const auto& [key, value] : metadata)
    WEAVE_CHECK(key.rfind("weave.crc32", 0) != 0, "safetensors",
                "metadata key '{}' is reserved (weave's checksums)", key);
  stored[kMetadataChecksum] = hex32(metadata_checksum(stored));
  std::vector<Tensor> data;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    WEAVE_CHECK(!name.empty() && name != "__metadata__", "safetensors",
                "tensor name '{}' is reserved or empty", name);
    WEAVE_CHECK(t.defined(), "safetensors", "tensor '{}' is undefined", name);
    WEAVE_CHECK(!header.contains(name), "safetensors", "tensor name '{}' appears twice", name);
    Tensor host = t.detach().cpu().contiguous();
    const uint64_t bytes = uint64_t(host.numel()) * host.itemsize();
    header[name] = {{"dtype", format_dtype(host.dtype())},
                    {"shape", host.shape().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    stored[kChecksumPrefix + name] = hex32(crc32_of(host.data_ptr(), bytes));
    data.push_back(host);
  }
  header["__metadata__"] = stored;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the format's recommended 8-byte alignment
  std::string out(8, '\0');
  const uint64_t length = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  out += text;
  out.reserve(out.size() + offset);
  for (const Tensor& t : data)
    out.append(static_cast<const char*>(t.data_ptr()), uint64_t(t.numel()) * t.itemsize());
  return out;
}

SafetensorsFile parse_safetensors(const void* bytes, size_t size, const std::string& name) {
  const auto* p = static_cast<const unsigned char*>(bytes);
  WEAVE_CHECK(size >= 8, "safetensors", "{} is truncated: {} bytes, not even the header length",
              name, size);
  uint64_t length = 0;
  for (int i = 0; i < 8; ++i) length |= uint64_t{p[i]} << (8 * i);
  WEAVE_CHECK(length <= kMaxHeaderBytes && length <= size - 8, "safetensors",
              "{} declares a {}-byte header, but the file holds {} bytes after the length{}", name,
              length, size - 8, length > kMaxHeaderBytes ? " (the format's limit is 100 MB)" : "");
  check_header_layout(p + 8, length, name);
  const json header = json::parse(p + 8, p + 8 + length, nullptr, false);
  WEAVE_CHECK(!header.is_discarded() && header.is_object(), "safetensors",
              "{}: the header is not a JSON object; hint: is this a safetensors file?", name);
  SafetensorsFile file;
  std::vector<Entry> entries;
  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      WEAVE_CHECK(value.is_object(), "safetensors", "{}: __metadata__ is not an object", name);
      for (const auto& [k, v] : value.items()) {
        WEAVE_CHECK(v.is_string(), "safetensors", "{}: metadata '{}' is not a string", name, k);
        file.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    entries.push_back(parse_entry(key, value, name));
  }
  // The data must be covered exactly: no overlaps, no holes, nothing after the last tensor.
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  const uint64_t data_size = size - 8 - length;
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
  const unsigned char* data = p + 8 + length;
  // Files weave wrote carry a CRC-32 of every tensor's bytes and of the user metadata: a
  // flipped bit anywhere is an error, not a silently different model. (Files from other
  // writers have none and load as they are.)
  // Any key of weave's checksum namespace marks the file as checked, so a flipped bit in one of
  // those keys cannot turn the checking off.
  bool checked = false;
  for (const auto& [key, value] : file.metadata)
    checked = checked || key.rfind("weave.crc32", 0) == 0;
  if (checked) {
    WEAVE_CHECK(file.metadata.count(kMetadataChecksum) == 1, "safetensors",
                "{}: the metadata checksum is missing: the file is corrupt", name);
    WEAVE_CHECK(file.metadata[kMetadataChecksum] == hex32(metadata_checksum(file.metadata)),
                "safetensors",
                "{}: the metadata fails its checksum (stored {}, computed {}): the file is "
                "corrupt",
                name, file.metadata[kMetadataChecksum], hex32(metadata_checksum(file.metadata)));
    size_t checksums = 0;
    for (const auto& [key, value] : file.metadata) checksums += key.rfind(kChecksumPrefix, 0) == 0;
    WEAVE_CHECK(checksums == entries.size(), "safetensors",
                "{}: {} tensors but {} checksums: the file is corrupt", name, entries.size(),
                checksums);
  }
  for (const Entry& e : entries) {
    if (checked) {
      auto stored = file.metadata.find(kChecksumPrefix + e.name);
      WEAVE_CHECK(stored != file.metadata.end(), "safetensors",
                  "{}: tensor '{}' has no checksum: the file is corrupt", name, e.name);
      const std::string actual = hex32(crc32_of(data + e.begin, e.end - e.begin));
      WEAVE_CHECK(stored->second == actual, "safetensors",
                  "{}: tensor '{}' fails its checksum (stored {}, computed {}): the file is "
                  "corrupt",
                  name, e.name, stored->second, actual);
    }
    Tensor t = empty(e.shape, {.dtype = e.dtype});
    if (e.end > e.begin) std::memcpy(t.data_ptr(), data + e.begin, e.end - e.begin);
    if (e.dtype == kBool)
      for (uint64_t i = e.begin; i < e.end; ++i)
        WEAVE_CHECK(data[i] <= 1, "safetensors", "{}: bool tensor '{}' holds the byte {}", name,
                    e.name, int(data[i]));
    file.tensors.emplace_back(e.name, t);
  }
  std::erase_if(file.metadata, [](const auto& item) {
    return item.first.rfind(kChecksumPrefix, 0) == 0 || item.first == kMetadataChecksum;
  });
  return file;
}

uint32_t checksum(const Tensor& t) {
  const Tensor host = t.detach().cpu().contiguous();
  return crc32_of(host.data_ptr(), size_t(host.numel()) * host.itemsize());
}

void write_file_atomically(const std::string& path, const std::string& bytes) {
  const std::filesystem::path target(path);
  std::string temp = path + ".tmp-XXXXXX";
  const int fd = mkstemp(temp.data());
  if (fd < 0) fail_io("create a temporary file next to", path);
  auto give_up = [&](const char* what) {
    const int saved = errno;
    ::close(fd);
    ::unlink(temp.c_str());
    errno = saved;
    fail_io(what, path);
  };
  // mkstemp creates the file 0600; a checkpoint gets the permissions of the file it replaces,
  // or those a new file would get under the umask.
  struct stat existing;
  mode_t mode = 0;
  if (::stat(path.c_str(), &existing) == 0) {
    mode = existing.st_mode & 07777;
  } else {
    const mode_t mask = ::umask(0);
    ::umask(mask);
    mode = 0666 & ~mask;
  }
  if (::fchmod(fd, mode) != 0) give_up("set the permissions of");
  size_t written = 0;
  while (written < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + written, bytes.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) give_up("write");
    written += size_t(n);
  }
  if (::fsync(fd) != 0) give_up("fsync");
  if (::close(fd) != 0) {
    ::unlink(temp.c_str());
    fail_io("close", path);
  }
  if (std::rename(temp.c_str(), path.c_str()) != 0) {
    const int saved = errno;
    ::unlink(temp.c_str());
    errno = saved;
    fail_io("rename a temporary file onto", path);
  }
  // The rename itself is durable only once the directory is.
  const std::string dir = target.has_parent_path() ? target.parent_path().string() : ".";
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dir_fd < 0) fail_io("open the directory of", path);
  const int synced = ::fsync(dir_fd);
  ::close(dir_fd);
  if (synced != 0) fail_io("fsync the directory of", path);
}

std::string read_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) fail_io("open", path);
  std::string bytes;
  char buffer[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int saved = errno;
      ::close(fd);
      errno = saved;
      fail_io("read", path);
    }
    if (n == 0) break;
    bytes.append(buffer, size_t(n));
  }
  ::close(fd);
  return bytes;
}

void save_safetensors(const std::string& path, const nn::NamedTensors& tensors,
                      const Metadata& metadata) {
  write_file_atomically(path, serialize_safetensors(tensors, metadata));
}

SafetensorsFile load_safetensors(const std::string& path) {
  const std::string bytes = read_file(path);
  return parse_safetensors(bytes.data(), bytes.size(), path);
}

}  // namespace weave::data
