#pragma once
// A new version of a directory's files written beside it and swapped in as one unit, so that a
// reader (or a crash at any instant) sees the old version whole or the new one whole, never a
// mix, and no file of the old version that the new one lacks stays behind.
//
//   data::StagedDirectory out("tuned/", is_model_file);   // stage: tuned/'s hidden sibling
//   write_files(out.path());                              // the new version's files
//   out.commit();   // one atomic swap; tuned/'s other entries (README.md, ...) carried over
//
// The staging folder is a hidden sibling of the directory (".<name>.staged-<random>"), on the
// same file system, so the swap is a rename (Linux's RENAME_EXCHANGE: the path never misses; a
// file system without it gets two renames, between which the path is briefly absent). Dropped
// without commit(), the staging folder is removed and the directory is untouched; a killed
// process leaves the staging folder behind (hidden) and the directory as it was, and the next
// StagedDirectory of that directory removes it (a live writer's, which it holds locked, stays).
#include <functional>
#include <string>

namespace weave::data {

class StagedDirectory {
 public:
  /// `replaced(name)`: whether the directory's top-level entry `name` belongs to the version
  /// being replaced. Those are dropped at commit(); every other entry is carried into the new
  /// version (hard links, or copies where links cannot be made) unless the new version writes
  /// an entry of that name. Creates the directory's parent folders; raises, naming the path,
  /// when the directory is a file or the staging folder cannot be made.
  StagedDirectory(const std::string& dir, std::function<bool(const std::string&)> replaced);
  ~StagedDirectory();
  StagedDirectory(const StagedDirectory&) = delete;
  StagedDirectory& operator=(const StagedDirectory&) = delete;

  /// Where the new version's files go.
  const std::string& path() const { return staging_; }
  /// The directory this replaces (absolute, its links resolved).
  const std::string& target() const { return target_; }
  /// Makes the staged files the directory's, durably (fsync), as one swap; then removes the
  /// old version. Entries another process added to the directory meanwhile are kept.
  void commit();

 private:
  void carry_entries();
  void release_locks();
  std::string target_, staging_;
  int lock_ = -1;         // flock on the staging folder while this writes it
  int target_lock_ = -1;  // ... and on the version it replaces, during commit()
  std::function<bool(const std::string&)> replaced_;
  bool committed_ = false;
};

}  // namespace weave::data
