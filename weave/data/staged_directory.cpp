#include "weave/data/staged_directory.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <tuple>
#include <utility>

#include "weave/data/files.h"
#include "weave/tensor/error.h"

namespace weave::data {

namespace {

namespace fs = std::filesystem;
constexpr const char* kStaged = "StagedDirectory";

// The directory's path made absolute, a link to a directory resolved (the swap replaces the
// directory it names, not the link), a trailing separator dropped.
fs::path absolute_target(const std::string& dir) {
  fs::path path = fs::absolute(fs::path(dir)).lexically_normal();
  if (path.filename().empty()) path = path.parent_path();
  std::error_code error;
  if (fs::is_symlink(path, error) && fs::is_directory(path, error)) path = fs::canonical(path);
  return path;
}

// Flushes a folder's entries (renames into it, new files) to disk; best effort.
void sync_folder(const fs::path& folder) {
  const int fd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

// Every regular file under `folder` flushed to disk (what the writers did not flush already
// costs little: their own data went to disk at their commit).
void sync_tree(const fs::path& folder) {
  for (const auto& entry : fs::recursive_directory_iterator(folder)) {
    if (entry.is_symlink() || !entry.is_regular_file()) continue;
    const int fd = ::open(entry.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ::fsync(fd);
    ::close(fd);
  }
  for (const auto& entry : fs::recursive_directory_iterator(folder))
    if (entry.is_directory() && !entry.is_symlink()) sync_folder(entry.path());
  sync_folder(folder);
}

// Swaps two paths in one step (renameat2 RENAME_EXCHANGE); false where the file system cannot.
bool exchange(const fs::path& a, const fs::path& b) {
#ifdef RENAME_EXCHANGE
  if (::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE) == 0) return true;
  if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP)
    fail_io("swap in the staged directory", b.string());
#endif
  return false;
}

// An exclusive lock on a folder (flock: it ends with the process, however that ends), or -1
// where the folder cannot be opened (gone, a link) or, without `wait`, another holds it.
int lock_folder(const fs::path& folder, bool wait) {
  const int fd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return -1;
  if (::flock(fd, LOCK_EX | (wait ? 0 : LOCK_NB)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// The staging folders beside `target` that no live writer holds: what killed exports left (a
// model's size each). Skipped while the target is absent: a swap killed between its two renames
// (file systems without RENAME_EXCHANGE) leaves the only copies there.
void sweep_abandoned(const fs::path& target) {
  std::error_code error;
  if (!fs::is_directory(target, error)) return;
  const std::string prefix = fmt::format(".{}.staged-", target.filename().string());
  for (const auto& entry : fs::directory_iterator(target.parent_path(), error)) {
    if (!entry.path().filename().string().starts_with(prefix) ||
        entry.symlink_status(error).type() != fs::file_type::directory)
      continue;
    const int fd = lock_folder(entry.path(), false);
    if (fd < 0) continue;  // a live writer's
    fs::remove_all(entry.path(), error);
    ::close(fd);
  }
}

// Makes a fresh staging folder beside `target` and locks it (a sweep removes only unlocked
// ones: one that took it between the two steps makes this try another name).
std::pair<std::string, int> make_staging(const fs::path& target) {
  std::random_device entropy;
  for (int attempt = 0; attempt < 16; ++attempt) {
    const fs::path staging =
        target.parent_path() /
        fmt::format(".{}.staged-{:08x}{:08x}", target.filename().string(), entropy(), entropy());
    if (::mkdir(staging.c_str(), 0755) != 0) {
      if (errno != EEXIST) fail_io("create the staging folder", staging.string());
      continue;
    }
    const int fd = lock_folder(staging, false);
    struct stat info {};
    if (fd >= 0 && ::fstat(fd, &info) == 0 && info.st_nlink > 0) return {staging.string(), fd};
    if (fd >= 0) ::close(fd);
  }
  WEAVE_FAIL(kStaged, "no free staging folder name beside {}", target.string());
}

}  // namespace

StagedDirectory::StagedDirectory(const std::string& dir,
                                 std::function<bool(const std::string&)> replaced)
    : replaced_(std::move(replaced)) {
  const fs::path target = absolute_target(dir);
  std::error_code error;
  WEAVE_CHECK(!fs::exists(target, error) || fs::is_directory(target, error), kStaged,
              "{} exists and is not a directory; hint: export into a directory", target.string());
  fs::create_directories(target.parent_path(), error);
  WEAVE_CHECK(!error, kStaged, "cannot create {}: {}", target.parent_path().string(),
              error.message());
  sweep_abandoned(target);
  std::tie(staging_, lock_) = make_staging(target);
  target_ = target.string();
}

StagedDirectory::~StagedDirectory() {
  if (!committed_ && !staging_.empty()) {
    std::error_code ignored;
    fs::remove_all(staging_, ignored);
  }
  release_locks();
}

void StagedDirectory::release_locks() {
  for (int* fd : {&lock_, &target_lock_})
    if (*fd >= 0) ::close(std::exchange(*fd, -1));
}

// The old version's entries that are not being replaced, into the staging folder: hard links
// (no copying), or copies where the file system refuses links.
void StagedDirectory::carry_entries() {
  for (const auto& entry : fs::directory_iterator(target_)) {
    const std::string name = entry.path().filename().string();
    const fs::path into = fs::path(staging_) / name;
    std::error_code error;
    if (replaced_(name) || fs::symlink_status(into, error).type() != fs::file_type::not_found)
      continue;
    const auto carry = fs::copy_options::recursive | fs::copy_options::copy_symlinks;
    fs::copy(entry.path(), into, carry | fs::copy_options::create_hard_links, error);
    if (error) {
      fs::remove_all(into, error);
      fs::copy(entry.path(), into, carry, error);
      WEAVE_CHECK(!error, kStaged, "cannot carry {} into the new version: {}",
                  entry.path().string(), error.message());
    }
  }
}

void StagedDirectory::commit() {
  WEAVE_CHECK(!committed_, kStaged, "{} is committed already", target_);
  const fs::path target(target_), staging(staging_);
  std::error_code error;
  const bool existed = fs::exists(target, error);
  // The version being replaced is locked too, so that no sweep takes it from its staging name
  // while entries others added are moved out of it (another commit waits here).
  if (existed) target_lock_ = lock_folder(target, true);
  if (existed) carry_entries();
  sync_tree(staging);
  fs::path old;
  if (!existed) {
    if (::rename(staging.c_str(), target.c_str()) != 0) fail_io("rename into", target_);
  } else if (exchange(staging, target)) {
    old = staging;  // the swap left the old version at the staging path
  } else {
    old = staging.string() + ".old";
    if (::rename(target.c_str(), old.c_str()) != 0) fail_io("move aside", target_);
    if (::rename(staging.c_str(), target.c_str()) != 0) fail_io("rename into", target_);
  }
  committed_ = true;
  sync_folder(target.parent_path());
  if (old.empty()) return release_locks();
  // Entries another process added to the old version while this one was staged stay.
  for (const auto& entry : fs::directory_iterator(old)) {
    const std::string name = entry.path().filename().string();
    if (replaced_(name) ||
        fs::symlink_status(target / name, error).type() != fs::file_type::not_found)
      continue;
    fs::rename(entry.path(), target / name, error);
  }
  fs::remove_all(old, error);
  release_locks();
}

}  // namespace weave::data
