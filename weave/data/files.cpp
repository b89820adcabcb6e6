// Atomic writes and exact reads of whole files and ranges (files.h).
#include "weave/data/files.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "weave/tensor/error.h"

namespace weave::data {

void fail_io(const char* what, const std::string& path) {
  WEAVE_FAIL("safetensors", "cannot {} {}: {}", what, path, std::strerror(errno));
}

ReadOnlyFile::ReadOnlyFile(const std::string& path) : fd(::open(path.c_str(), O_RDONLY)) {
  if (fd < 0) fail_io("open", path);
}

ReadOnlyFile::~ReadOnlyFile() {
  ::close(fd);
}

void read_exactly_at(int fd, void* dest, uint64_t size, uint64_t offset, const std::string& path) {
  auto* out = static_cast<char*>(dest);
  while (size > 0) {
    const ssize_t n = ::pread(fd, out, size, off_t(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail_io("read", path);
    WEAVE_CHECK(n > 0, "safetensors", "{} is truncated: it ends before byte {}", path, offset);
    out += n;
    size -= uint64_t(n);
    offset += uint64_t(n);
  }
}

AtomicFileWriter::AtomicFileWriter(std::string path)
    : path_(std::move(path)), temp_(path_ + ".tmp-XXXXXX") {
  // mkstemp creates a new file (O_EXCL: never one another user planted) with mode 0600; the
  // target's permissions are applied below.
  fd_ = ::mkstemp(temp_.data());
  if (fd_ < 0) fail_io("create a temporary file next to", path_);
  struct stat existing;
  mode_t mode = 0;
  if (::stat(path_.c_str(), &existing) == 0) {
    mode = existing.st_mode & 07777;
  } else {
    const mode_t mask = ::umask(0);
    ::umask(mask);
    mode = 0666 & ~mask;
  }
  if (::fchmod(fd_, mode) != 0) fail("set the permissions of");
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!temp_.empty()) ::unlink(temp_.c_str());
}

void AtomicFileWriter::fail(const char* what) {
  const int saved = errno;
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  ::unlink(temp_.c_str());
  temp_.clear();
  errno = saved;
  fail_io(what, path_);
}

void AtomicFileWriter::write_at(const void* data, uint64_t size, uint64_t offset) {
  WEAVE_CHECK(offset <= size_ && size <= size_ - offset, "files",
              "{}: write_at overwrites bytes written earlier, but [{}, {}) reaches past the {} "
              "bytes written so far; hint: append with write()",
              path_, offset, offset + size, size_);
  put(data, size, offset);
}

void AtomicFileWriter::put(const void* data, uint64_t size, uint64_t offset) {
  WEAVE_CHECK(fd_ >= 0, "files", "{}: written after it was committed or failed", path_);
  const auto* bytes = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::pwrite(fd_, bytes, size, off_t(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail("write");
    bytes += n;
    size -= uint64_t(n);
    offset += uint64_t(n);
  }
}

void AtomicFileWriter::write(const void* data, uint64_t size) {
  put(data, size, size_);
  size_ += size;
}

void AtomicFileWriter::commit() {
  WEAVE_CHECK(fd_ >= 0, "files", "{}: committed twice, or after a failed write", path_);
  if (::fsync(fd_) != 0) fail("fsync");
  const int closed = ::close(fd_);
  fd_ = -1;
  if (closed != 0) fail("close");
  if (std::rename(temp_.c_str(), path_.c_str()) != 0) fail("rename a temporary file onto");
  temp_.clear();
  // The rename itself is durable only once the directory is.
  const std::filesystem::path target(path_);
  const std::string dir = target.has_parent_path() ? target.parent_path().string() : ".";
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dir_fd < 0) fail_io("open the directory of", path_);
  const int synced = ::fsync(dir_fd);
  ::close(dir_fd);
  if (synced != 0) fail_io("fsync the directory of", path_);
}

void write_file_atomically(const std::string& path, const std::string& bytes) {
  AtomicFileWriter out(path);
  out.write(bytes.data(), bytes.size());
  out.commit();
}

std::string read_file(const std::string& path) {
  // Not blocking in open: a FIFO planted under a file's name would wait for a writer forever.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) fail_io("open", path);
  struct stat info {};
  if (::fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
    ::close(fd);
    WEAVE_FAIL("read_file",
               "{} is not a regular file (a folder, a FIFO or a device, which may never end); "
               "hint: name the file itself",
               path);
  }
  std::string bytes;
  bytes.reserve(size_t(info.st_size));
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

std::optional<ExclusiveFileLock> ExclusiveFileLock::try_acquire(const std::string& path,
                                                                const std::string& owner,
                                                                std::string* holder) {
  // Never through a link: whoever can add entries to the directory could point the lock at any
  // file this job may write, which the owner record below would overwrite.
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644);
  WEAVE_CHECK(fd >= 0 || errno != ELOOP, "lock",
              "{} is a symbolic link; a lock file is never opened through one (the job would "
              "overwrite the file it names); hint: remove the link, and keep checkpoint "
              "directories writable by the job's user only",
              path);
  if (fd < 0) fail_io("create the lock file", path);
  struct stat st {};
  const bool stated = ::fstat(fd, &st) == 0;
  if (!stated || !S_ISREG(st.st_mode) || st.st_uid != ::geteuid()) {
    ::close(fd);
    WEAVE_FAIL("lock",
               "{} must be a regular file owned by this job's user (uid {}), found {} owned by "
               "uid {}; hint: remove it, and keep checkpoint directories writable by the job's "
               "user only",
               path, ::geteuid(),
               !stated               ? "nothing readable"
               : S_ISREG(st.st_mode) ? "a file"
                                     : "not a regular file",
               stated ? int64_t(st.st_uid) : int64_t(-1));
  }
  int locked;
  do {
    locked = ::flock(fd, LOCK_EX | LOCK_NB);
  } while (locked != 0 && errno == EINTR);
  if (locked != 0) {
    const int why = errno;
    holder->clear();
    char buffer[512];
    const ssize_t n = ::pread(fd, buffer, sizeof buffer, 0);
    if (n > 0) holder->assign(buffer, size_t(n));
    ::close(fd);
    if (why == EWOULDBLOCK) return std::nullopt;
    errno = why;
    fail_io("lock", path);
  }
  // The record is for the message of whoever fails to take the lock next; losing it to a
  // failed write costs only that message's detail.
  const bool recorded = ::ftruncate(fd, 0) == 0 &&
                        ::pwrite(fd, owner.data(), owner.size(), 0) == ssize_t(owner.size());
  (void)recorded;
  return ExclusiveFileLock(fd);
}

ExclusiveFileLock& ExclusiveFileLock::operator=(ExclusiveFileLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

ExclusiveFileLock::~ExclusiveFileLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the last descriptor releases the lock
}

std::vector<std::string> files_in(const std::string& path,
                                  const std::vector<std::string>& skip_suffixes) {
  namespace fs = std::filesystem;
  WEAVE_CHECK(fs::exists(path), "files", "{} does not exist", path);
  if (!fs::is_directory(path)) {
    // A FIFO would block the read, a device (/dev/zero) never end it.
    WEAVE_CHECK(fs::is_regular_file(path), "files",
                "{} is neither a regular file nor a folder; hint: name text files or folders",
                path);
    return {path};
  }
  std::vector<std::string> files;
  for (const auto& entry : fs::directory_iterator(path)) {
    const std::string name = entry.path().string();
    const bool skipped = std::any_of(skip_suffixes.begin(), skip_suffixes.end(),
                                     [&](const std::string& s) { return name.ends_with(s); });
    if (entry.is_regular_file() && !entry.is_symlink() && !skipped) files.push_back(name);
  }
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace weave::data
