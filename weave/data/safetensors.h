#pragma once
// The safetensors format (Hugging Face): an 8-byte little-endian header length, a JSON header
// naming each tensor's dtype, shape and byte range, then the bytes. Files written here load in
// the Python `safetensors` package and the other way round.
//
//   data::save_safetensors("model.safetensors", model.state_dict(), {{"epoch", "3"}});
//   auto file = data::load_safetensors("model.safetensors");   // file.tensors, file.metadata
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "weave/data/files.h"
#include "weave/nn/module.h"

namespace weave::data {

/// String metadata stored in the header's "__metadata__" entry.
using Metadata = std::map<std::string, std::string>;

struct SafetensorsFile {
  nn::NamedTensors tensors;  // in file order (sorted by offset)
  Metadata metadata;
};

/// The whole file image: header and data (CPU copies of the tensors, contiguous, in order).
/// Names must be unique and non-empty; "__metadata__" is reserved.
std::string serialize_safetensors(const nn::NamedTensors& tensors, const Metadata& metadata = {});
/// Parses a file image; every inconsistency (truncated data, a header that is not JSON or not
/// the format, an unknown dtype, a byte range that does not fit the shape, overlaps or gaps
/// between tensors) raises weave::Error naming `name` and the tensor.
SafetensorsFile parse_safetensors(const void* data, size_t size, const std::string& name);

/// Where a tensor's bytes lie: [begin, end) of the data section.
struct SafetensorsEntry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin, end;
};

/// A file's header, read without its data, for reading parts of the file.
struct SafetensorsHeader {
  std::string path;
  std::vector<SafetensorsEntry> entries;  // by offset
  Metadata metadata;                      // the checksums taken out (the metadata's verified)
  uint64_t data_start = 0;                // file offset of the data section
  /// Whether weave wrote it: each tensor's CRC-32 and each data block's.
  bool checked = false;
  std::map<std::string, uint32_t> checksums;
  uint64_t block_bytes = 0;
  std::vector<uint32_t> block_checksums;
  uint64_t bytes_read = 0;  // by read_safetensors_header
};

/// Reads and checks the header only (what parse_safetensors checks short of the data).
SafetensorsHeader read_safetensors_header(const std::string& path);

/// Bytes [begin, end) of the data section, to be copied to dest.
struct ByteRange {
  uint64_t begin, end;
  void* dest;
};
/// Reads the ranges with ranged reads: in a file weave wrote, the checksum blocks that hold
/// them (each verified; a mismatch raises naming the bytes), else exactly the ranges. Returns
/// the bytes read.
uint64_t read_safetensors_ranges(const SafetensorsHeader& header, std::vector<ByteRange> ranges);

/// A tensor a SafetensorsWriter will write.
struct SafetensorsSpec {
  std::string name;
  DType dtype;
  Shape shape;
};

/// Writes a file one tensor at a time, so that a writer holds at most one tensor (a converted
/// or strided one a piece at a time): the names, dtypes and shapes come first, the values in
/// that order, and commit() writes the header with weave's checksums (as save_safetensors) and
/// replaces path atomically. Dropped before commit(), it leaves path as it was.
///
///   data::SafetensorsWriter out("big.safetensors", {{"w", kBFloat16, {4096, 4096}}});
///   out.write(w_float32.t());   // converted and copied 16 MB at a time
///   out.commit();
class SafetensorsWriter {
 public:
  SafetensorsWriter(const std::string& path, std::vector<SafetensorsSpec> tensors,
                    const Metadata& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  /// The next tensor's values: any tensor (device, dtype, strides) with its number of elements,
  /// taken in row-major order and converted to its dtype.
  void write(const Tensor& values);
  /// After the last tensor: the header, then the file replaces path.
  void commit();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Writes path atomically (see write_file_atomically): a crash leaves the old file or the new.
void save_safetensors(const std::string& path, const nn::NamedTensors& tensors,
                      const Metadata& metadata = {});
SafetensorsFile load_safetensors(const std::string& path);

}  // namespace weave::data
