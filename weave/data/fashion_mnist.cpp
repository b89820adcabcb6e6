#include "weave/data/fashion_mnist.h"

#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>

namespace weave::data {

namespace {

struct GzCloser {
  void operator()(gzFile f) const { gzclose(f); }
};

void read_exact(gzFile file, void* out, size_t n, const std::string& path, const char* what) {
  char* dst = static_cast<char*>(out);
  while (n > 0) {
    int chunk = static_cast<int>(std::min<size_t>(n, 1 << 30));
    int got = gzread(file, dst, static_cast<unsigned>(chunk));
    if (got <= 0) {
      int code = 0;
      const char* message = gzerror(file, &code);
      WEAVE_FAIL("fashion_mnist", "{} is truncated or corrupt while reading {}: {}", path, what,
                 code != Z_OK ? message : "unexpected end of file");
    }
    dst += got;
    n -= static_cast<size_t>(got);
  }
}

}  // namespace

Tensor read_idx(const std::string& path) {
  std::unique_ptr<gzFile_s, GzCloser> file(gzopen(path.c_str(), "rb"));
  WEAVE_CHECK(file != nullptr, "fashion_mnist",
              "cannot open {}: {}; hint: apt-get install dataset-fashion-mnist, or pass the "
              "directory that holds the IDX files",
              path, std::strerror(errno));
  unsigned char magic[4];
  read_exact(file.get(), magic, 4, path, "the header");
  WEAVE_CHECK(magic[0] == 0 && magic[1] == 0 && magic[2] == 0x08 && magic[3] >= 1 && magic[3] <= 4,
              "fashion_mnist",
              "{} is not an unsigned-byte IDX file: magic {:02x} {:02x} {:02x} {:02x}, expected "
              "00 00 08 0N",
              path, magic[0], magic[1], magic[2], magic[3]);
  Shape shape;
  for (int d = 0; d < magic[3]; ++d) {
    unsigned char be[4];
    read_exact(file.get(), be, 4, path, "the dimensions");
    shape.push_back((int64_t{be[0]} << 24) | (int64_t{be[1]} << 16) | (int64_t{be[2]} << 8) |
                    be[3]);
  }
  WEAVE_CHECK(shape.numel() <= (int64_t{1} << 32), "fashion_mnist",
              "{} declares an implausible shape {}", path, shape);
  Tensor data = empty(shape, {.dtype = kUInt8});
  read_exact(file.get(), data.data_ptr(), static_cast<size_t>(shape.numel()), path, "the data");
  return data;
}

MnistSplit load_fashion_mnist(const std::string& dir, bool train) {
  const std::string prefix = train ? "train" : "t10k";
  auto find = [&](const std::string& stem) {
    std::string gz = dir + "/" + stem + ".gz";
    return std::filesystem::exists(gz) ? gz : dir + "/" + stem;
  };
  Tensor images = read_idx(find(prefix + "-images-idx3-ubyte"));
  Tensor labels = read_idx(find(prefix + "-labels-idx1-ubyte"));
  WEAVE_CHECK(images.dim() == 3 && labels.dim() == 1 && images.size(0) == labels.size(0),
              "fashion_mnist", "images {} and labels {} do not match in {}", images.shape(),
              labels.shape(), dir);
  WEAVE_CHECK(max(labels).item<int64_t>() <= 9, "fashion_mnist",
              "labels in {} exceed class 9: corrupt file", dir);
  return {images, labels.to(kInt64)};
}

}  // namespace weave::data
