#pragma once
// Files as checkpoints need them: atomic replacement, whole reads, and exact ranged reads, each
// raising weave::Error that names the file and the system's reason.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace weave::data {

/// Replaces path with `bytes` so that a crash at any instant leaves either the old file or the
/// new one: write a temporary file in the same directory, fsync it, rename it over path, fsync
/// the directory.
void write_file_atomically(const std::string& path, const std::string& bytes);

/// What write_file_atomically does, for a file written in pieces (one tensor at a time): the
/// bytes go to a temporary file beside path, commit() replaces path with it durably; dropped
/// before commit() (an error, an exception), the temporary file is removed and path is left as
/// it was. The file gets the permissions of the one it replaces, or a new file's under the umask.
///
///   data::AtomicFileWriter out("model.safetensors");
///   out.write(header.data(), header.size());   // then each tensor's bytes
///   out.write_at(final_header.data(), final_header.size(), 0);
///   out.commit();
class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(std::string path);
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  /// Appends `size` bytes.
  void write(const void* data, uint64_t size);
  /// Overwrites bytes [offset, offset + size) written earlier (raises past size()).
  void write_at(const void* data, uint64_t size, uint64_t offset);
  /// Bytes appended so far.
  uint64_t size() const { return size_; }
  /// Flushes the file to disk and renames it onto path, then flushes the directory.
  void commit();

 private:
  [[noreturn]] void fail(const char* what);
  void put(const void* data, uint64_t size, uint64_t offset);
  std::string path_, temp_;
  int fd_ = -1;
  uint64_t size_ = 0;
};
/// The whole file; raises naming path if it cannot be read or is no regular file (a FIFO
/// would wait for a writer, a device might never end).
std::string read_file(const std::string& path);

/// The regular files of a folder in name order (links, and names ending in one of
/// skip_suffixes, left out), or `path` itself when it is a regular file; raises when it does not
/// exist or is neither (a FIFO, a device).
std::vector<std::string> files_in(const std::string& path,
                                  const std::vector<std::string>& skip_suffixes = {});

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

/// An exclusive advisory lock (flock) on a file, held until this object is destroyed or the
/// process ends (a killed holder leaves no stale lock). Processes that take it on the same
/// file, on one host or over a shared file system, exclude each other.
class ExclusiveFileLock {
 public:
  /// Takes the lock on path (creating the file) without waiting and records `owner` in the
  /// file. When another process holds it, returns nothing and sets *holder to what that
  /// process recorded (empty if it had not yet). Raises if the file cannot be created.
  static std::optional<ExclusiveFileLock> try_acquire(const std::string& path,
                                                      const std::string& owner,
                                                      std::string* holder);
  ExclusiveFileLock(ExclusiveFileLock&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  ExclusiveFileLock& operator=(ExclusiveFileLock&& other) noexcept;
  ~ExclusiveFileLock();

 private:
  explicit ExclusiveFileLock(int fd) : fd_(fd) {}
  int fd_ = -1;
};

}  // namespace weave::data
