#pragma once
// Files as checkpoints need them: atomic replacement, whole reads, and exact ranged reads, each
// raising weave::Error that names the file and the system's reason.
#include <cstdint>
#include <string>

namespace weave::data {

/// Replaces path with `bytes` so that a crash at any instant leaves either the old file or the
/// new one: write a temporary file in the same directory, fsync it, rename it over path, fsync
/// the directory.
void write_file_atomically(const std::string& path, const std::string& bytes);
/// The whole file; raises naming path if it cannot be read.
std::string read_file(const std::string& path);

/// Raises "cannot <what> <path>: <the reason errno gives>".
[[noreturn]] void fail_io(const char* what, const std::string& path);

/// A file open for reading, closed when it goes out of scope; raises if it cannot be opened.
struct ReadOnlyFile {
  int fd;
  explicit ReadOnlyFile(const std::string& path);
  ~ReadOnlyFile();
  ReadOnlyFile(const ReadOnlyFile&) = delete;
  ReadOnlyFile& operator=(const ReadOnlyFile&) = delete;
};

/// Reads exactly `size` bytes at `offset` of an open file: a short read means path is
/// truncated, and raises saying so.
void read_exactly_at(int fd, void* dest, uint64_t size, uint64_t offset, const std::string& path);

}  // namespace weave::data
