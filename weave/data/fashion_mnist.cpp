#include "weave/data/fashion_mnist.h"

#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>

namespace weave::data {

namespace {

struct GzCloser {
  void operator()(gzFile f) const { gzclose(f); }
};

// Reads up to n bytes; returns how many it got (fewer only at the end of the input).
using ReadSome = std::function<size_t(void* out, size_t n)>;

uint32_t big_endian(const unsigned char* b) {
  return (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | b[3];
}

// The IDX format: magic 00 00 08 NDIM (08: unsigned bytes), NDIM big-endian uint32 sizes, then
// exactly prod(sizes) bytes. The data is read in pieces before any tensor exists, so a header
// that claims more than the file holds costs no more memory than the file itself.
Tensor parse_idx(const ReadSome& read, const std::string& name) {
  unsigned char header[4];
  WEAVE_CHECK(read(header, 4) == 4, "read_idx", "{} is truncated: no complete IDX header", name);
  WEAVE_CHECK(
      header[0] == 0 && header[1] == 0 && header[2] == 0x08 && header[3] >= 1 && header[3] <= 4,
      "read_idx",
      "{} is not an unsigned-byte IDX file: magic {:02x} {:02x} {:02x} {:02x}, expected "
      "00 00 08 0N (N = 1..4 dimensions)",
      name, header[0], header[1], header[2], header[3]);
  Shape shape;
  int64_t count = 1;
  for (int d = 0; d < header[3]; ++d) {
    unsigned char be[4];
    WEAVE_CHECK(read(be, 4) == 4, "read_idx", "{} is truncated inside its list of sizes", name);
    shape.push_back(big_endian(be));
    WEAVE_CHECK(!__builtin_mul_overflow(count, shape.back(), &count) && count <= (int64_t{1} << 40),
                "read_idx", "{} declares sizes {}, more data than any IDX dataset holds", name,
                shape);
  }
  std::vector<uint8_t> bytes;
  constexpr size_t kPiece = size_t{1} << 20;
  while (static_cast<int64_t>(bytes.size()) < count) {
    const size_t want = std::min<size_t>(kPiece, static_cast<size_t>(count) - bytes.size());
    const size_t old = bytes.size();
    bytes.resize(old + want);
    const size_t got = read(bytes.data() + old, want);
    bytes.resize(old + got);
    WEAVE_CHECK(got == want, "read_idx",
                "{} is truncated: its header declares {} bytes of data ({}), the file holds {}",
                name, count, shape, bytes.size());
  }
  unsigned char extra;
  WEAVE_CHECK(read(&extra, 1) == 0, "read_idx",
              "{} holds more data than its header declares ({} bytes for {}): corrupt file", name,
              count, shape);
  Tensor data = empty(shape, {.dtype = kUInt8});
  if (count > 0) std::memcpy(data.data_ptr(), bytes.data(), bytes.size());
  return data;
}

}  // namespace

Tensor read_idx(const std::string& path) {
  std::unique_ptr<gzFile_s, GzCloser> file(gzopen(path.c_str(), "rb"));
  WEAVE_CHECK(file != nullptr, "read_idx",
              "cannot open {}: {}; hint: apt-get install dataset-fashion-mnist, or pass the "
              "directory that holds the IDX files",
              path, std::strerror(errno));
  return parse_idx(
      [&](void* out, size_t n) {
        size_t total = 0;
        while (total < n) {
          const int got = gzread(file.get(), static_cast<char*>(out) + total,
                                 static_cast<unsigned>(std::min<size_t>(n - total, 1 << 30)));
          if (got == 0) break;
          if (got < 0) {
            int code = 0;
            const char* message = gzerror(file.get(), &code);
            WEAVE_FAIL("read_idx", "{} is corrupt: {}", path, message);
          }
          total += static_cast<size_t>(got);
        }
        return total;
      },
      path);
}

Tensor read_idx_bytes(const void* data, size_t size, const std::string& name) {
  size_t position = 0;
  return parse_idx(
      [&](void* out, size_t n) {
        const size_t got = std::min(n, size - position);
        if (got > 0) std::memcpy(out, static_cast<const char*>(data) + position, got);
        position += got;
        return got;
      },
      name);
}

MnistSplit load_fashion_mnist(const std::string& dir, bool train) {
  const std::string prefix = train ? "train" : "t10k";
  auto find = [&](const std::string& stem) {
    std::string gz = dir + "/" + stem + ".gz";
    return std::filesystem::exists(gz) ? gz : dir + "/" + stem;
  };
  Tensor images = read_idx(find(prefix + "-images-idx3-ubyte"));
  Tensor labels = read_idx(find(prefix + "-labels-idx1-ubyte"));
  WEAVE_CHECK(images.dim() == 3 && labels.dim() == 1 && images.size(0) == labels.size(0) &&
                  labels.numel() > 0,
              "fashion_mnist",
              "images {} and labels {} in {} do not form a dataset (expected [N, H, W] images "
              "and [N] labels, N > 0)",
              images.shape(), labels.shape(), dir);
  WEAVE_CHECK(max(labels).item<int64_t>() <= 9, "fashion_mnist",
              "labels in {} exceed class 9: corrupt file", dir);
  return {images, labels.to(kInt64)};
}

}  // namespace weave::data
