#include "weave/parallel/checkpoint/sharded_checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <regex>
#include <thread>

#include "weave/data/files.h"
#include "weave/parallel/checkpoint/checkpoint_index.h"
#include "weave/parallel/checkpoint/reshard.h"
#include "weave/parallel/checkpoint/saved_pieces.h"
#include "weave/parallel/core/agree.h"
#include "weave/parallel/core/reproducible.h"
#include "weave/tensor/checksum.h"

namespace weave::parallel {

namespace {

namespace fs = std::filesystem;

std::string shard_name(int rank, int size, int64_t generation) {
  return fmt::format("rank-{:05d}-of-{:05d}.g{}.safetensors", rank, size, generation);
}

// The names this format writes, and the temporaries of their atomic writes: the only files a
// save ever deletes (the user's own files in the directory are never touched).
bool is_generation_file(const std::string& name) {
  return detail::generation_of(name) >= 0;
}
// Held by a save from its start to its commit (ExclusiveFileLock: released by a killed holder).
constexpr const char* kSaveLockName = ".weave-save.lock";

bool is_our_temporary(const std::string& name) {
  static const std::regex pattern(
      R"(((rank-\d{5}-of-\d{5}|all-\d{5}-ranks)\.g\d+\.safetensors|index\.json)\.tmp-[A-Za-z0-9]{6})");
  return std::regex_match(name, pattern);
}

int64_t current_generation(const std::string& dir) {
  if (!fs::exists(dir + "/index.json")) return 0;
  try {
    return detail::read_checkpoint_index(dir).generation;
  } catch (const Error&) {
    return 0;  // an unreadable index is replaced by this save
  }
}

// Contents under "rank<r>/" with the prefix removed.
data::SafetensorsFile rank_part(const data::SafetensorsFile& all, int rank) {
  const std::string prefix = fmt::format("rank{}/", rank);
  data::SafetensorsFile out;
  for (const auto& [name, t] : all.tensors)
    if (name.rfind(prefix, 0) == 0) out.tensors.emplace_back(name.substr(prefix.size()), t);
  for (const auto& [key, value] : all.metadata)
    if (key.rfind(prefix, 0) == 0) out.metadata[key.substr(prefix.size())] = value;
  return out;
}

// One save from its generation on: the files it writes, then the commit of its index.
struct Save {
  std::string dir;
  dist::Group group;
  // Where the commit communicates: the group itself (a synchronous save), or a duplicate of it
  // (an asynchronous save commits on its writer thread, beside the training's collectives).
  dist::Group commit_group;
  int64_t generation = 0;
  std::string save_id;  // in every file and the index: ties the save's files together
  bool single_file = false;
  std::vector<std::string> files;
  // This rank's part (every rank), or every rank's parts (group rank 0, single_file).
  data::SafetensorsFile contents;
  // Set by the writer: the bytes of this rank's file (-1: it writes none), or its error.
  int64_t written = -1;
  uint32_t crc = 0;  // of the file's bytes
  std::exception_ptr error;
  std::exception_ptr commit_error;  // an asynchronous save's commit, raised by whoever joins it
  std::thread writer;               // an asynchronous save's background writer and committer
  // Group rank 0 holds the directory from the choice of generation until the commit's end: a
  // second job saving into it meanwhile gets a clear error, not a file system's.
  std::optional<data::ExclusiveFileLock> directory_lock;

  Save() = default;
  Save(const Save&) = delete;
  Save& operator=(const Save&) = delete;
  // A process that exits with a save pending (no finalize) still lets the write finish.
  ~Save() {
    if (writer.joinable()) writer.join();
  }
};

// The asynchronous save still being written or committed (one per process: the next save, a
// load, wait_for_checkpoint or finalize waits for it and raises its error).
std::mutex pending_mutex;
std::unique_ptr<Save> pending;

// This rank's file: serialized and written atomically (local work only: it may run on a
// background thread). Records the size or the error.
void write_files(Save& save) {
  try {
    const bool writes = !save.single_file || save.group.rank() == 0;
    if (!writes) return;
    const std::string& name = save.files[save.single_file ? 0 : size_t(save.group.rank())];
    const std::string image =
        data::serialize_safetensors(save.contents.tensors, save.contents.metadata);
    data::write_file_atomically(save.dir + "/" + name, image);
    save.written = int64_t(image.size());
    save.crc = checksum_bytes(image.data(), image.size());
  } catch (...) {
    save.error = std::current_exception();
  }
  save.contents = {};  // the host copies go as soon as they are on disk
}

// The commit point, collective over the save's group: every rank learns whether every write
// succeeded, then group rank 0 checks each file's size where the index will point and
// replaces the index atomically; then the older generations are deleted.
void commit(Save& save) {
  const char* op = "save_sharded_checkpoint";
  const dist::Group& group = save.commit_group;
  const int rank = group.rank(), size = group.size();
  detail::run_together(op, group,
                       save.single_file ? "write the gathered checkpoint" : "write its shard", [&] {
                         if (save.error) std::rethrow_exception(save.error);
                       });
  // Each rank's file size and CRC-32.
  Tensor written = empty({2 * size}, {.dtype = kInt64});
  dist::all_gather(written, from_vector<int64_t>({save.written, int64_t(save.crc)}, {2}), group);
  const std::vector<int64_t> size_and_crc = written.to_vector<int64_t>();
  detail::CheckpointIndex index{.world_size = size,
                                .generation = save.generation,
                                .single_file = save.single_file,
                                .files = save.files,
                                .save_id = save.save_id,
                                .checksums = {}};
  std::vector<int64_t> sizes;
  for (size_t i = 0; i < save.files.size(); ++i) {
    sizes.push_back(size_and_crc[2 * i]);
    index.checksums.push_back(uint32_t(size_and_crc[2 * i + 1]));
  }
  detail::run_together(op, group, "commit the index", [&] {
    if (rank != 0) return;
    for (size_t i = 0; i < save.files.size(); ++i) {
      std::error_code ec;
      const auto found = fs::file_size(save.dir + "/" + save.files[i], ec);
      WEAVE_CHECK(!ec && int64_t(found) == sizes[i], op,
                  "{}/{} is {} after its writer wrote {} bytes; the index was not replaced and the "
                  "previous checkpoint stays; hint: every rank must see the same directory (a "
                  "shared file system)",
                  save.dir, save.files[i], ec ? "missing" : fmt::format("{} bytes", found),
                  sizes[i]);
    }
    data::write_file_atomically(save.dir + "/index.json", index.dump());
  });
  // Older generations are garbage now, and so are temporaries that killed saves left behind
  // (every rank's writes of this save are complete: nothing of ours is being written).
  if (rank == 0) {
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(save.dir, ec)) {
      const std::string name = entry.path().filename().string();
      const bool stale =
          (is_generation_file(name) &&
           std::find(save.files.begin(), save.files.end(), name) == save.files.end()) ||
          is_our_temporary(name);
      std::error_code ignored;
      if (stale) fs::remove(entry.path(), ignored);
    }
  }
  save.directory_lock.reset();  // committed: another job may take the directory now
}

// An asynchronous save's thread: its file, then, as soon as every rank's is written, the commit
// (on the duplicated group), so a crash after that loses nothing of this save.
void write_and_commit(Save& save) {
  write_files(save);
  try {
    commit(save);
  } catch (...) {
    save.commit_error = std::current_exception();
  }
}

void complete_pending() {
  std::unique_ptr<Save> save;
  {
    std::lock_guard lock(pending_mutex);
    save = std::move(pending);
  }
  if (!save) return;
  const dist::KeepAlive alive;  // the writes may outlast weave-run's --hang-timeout
  if (save->writer.joinable()) save->writer.join();
  if (save->commit_error) std::rethrow_exception(save->commit_error);
}

// The duplicate of each group that asynchronous saves commit on: made once per group (every
// member makes it in its first asynchronous save, in the same place of the group's order),
// dropped at finalize.
std::mutex commit_groups_mutex;
std::map<std::vector<int>, dist::Group> commit_groups;

dist::Group commit_group_for(const dist::Group& group) {
  std::lock_guard lock(commit_groups_mutex);
  auto found = commit_groups.find(group.ranks());
  if (found != commit_groups.end()) return found->second;
  return commit_groups.emplace(group.ranks(), dist::duplicate(group)).first->second;
}

// Deep copies on the host: training may change the live tensors as soon as the save returns.
data::SafetensorsFile host_copy(data::SafetensorsFile contents) {
  for (auto& entry : contents.tensors) {
    const Tensor live = entry.second.detach();
    entry.second = live.device().is_cuda() ? live.to(kCPU) : live.clone();
  }
  return contents;
}

// The save lock of `dir`, or an error naming who holds it.
data::ExclusiveFileLock lock_directory(const std::string& dir, const char* op,
                                       const std::string& save_id) {
  char host[256] = "?";
  ::gethostname(host, sizeof host - 1);
  const std::time_t now = std::time(nullptr);
  char when[32] = "?";
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", std::gmtime(&now));
  std::string holder;
  std::optional<data::ExclusiveFileLock> lock = data::ExclusiveFileLock::try_acquire(
      dir + "/" + kSaveLockName,
      fmt::format("process {} on {}, save {}, begun {}", ::getpid(), host, save_id, when), &holder);
  WEAVE_CHECK(lock.has_value(), op,
              "another save into {} is in progress ({}); two jobs saving into one directory "
              "would replace each other's checkpoints; hint: give each job a checkpoint "
              "directory of its own",
              dir, holder.empty() ? "its holder has not said who it is yet" : holder);
  return std::move(*lock);
}

// Group rank 0 prepares the directory and picks the generation and the save id; every rank
// learns both.
void prepare_save(Save& save, const char* op) {
  const std::string& dir = save.dir;
  Tensor generation_and_id = zeros({2}, {.dtype = kInt64});
  detail::run_together(op, save.group, "prepare the checkpoint directory", [&] {
    if (save.group.rank() != 0) return;
    std::error_code ec;
    fs::create_directories(dir, ec);
    WEAVE_CHECK(!ec, op, "cannot create {}: {}", dir, ec.message());
    std::random_device entropy;
    const int64_t id = (int64_t(entropy()) << 31) ^ int64_t(entropy());
    save.directory_lock = lock_directory(dir, op, fmt::format("{:x}", id));
    const int64_t current = current_generation(dir);
    WEAVE_CHECK(current < std::numeric_limits<int64_t>::max(), op,
                "the checkpoint in {} is at generation {}, the last an int64 can number; a save "
                "would overwrite it with an unreadable one; nothing was changed; hint: copy the "
                "checkpoint's files to a new directory (they load from there) and save there",
                dir, current);
    generation_and_id.copy_(from_vector<int64_t>({current + 1, id}, {2}));
  });
  dist::broadcast(generation_and_id, 0, save.group);
  const std::vector<int64_t> generation_id = generation_and_id.to_vector<int64_t>();
  save.generation = generation_id[0];
  save.save_id = fmt::format("{:x}-g{}", generation_id[1], save.generation);
}

// One checkpoint, one directory: ranks that name different ones would each write a part that
// the other's index does not find.
void check_same_directory(const std::string& dir, const dist::Group& group, const char* op) {
  // Every overload here takes an error_code: a path the file system rejects is this check's
  // business, not a std::filesystem_error's.
  std::error_code path_error;
  fs::path absolute = dir.empty() ? fs::path() : fs::absolute(dir, path_error);
  if (!path_error) absolute = fs::weakly_canonical(absolute, path_error);
  const std::string where = dir.empty() ? "(an empty path)" : path_error ? dir : absolute.string();
  detail::check_same_lines({where}, group, op, "the checkpoint directory",
                           "every rank of the group saves into the same directory (a shared "
                           "file system), with the same path");
  WEAVE_CHECK(!dir.empty(), op,
              "expected a directory to save into, found an empty path; hint: pass a path such "
              "as \"checkpoints/step_1000\"");
}

// Group rank 0 receives every rank's serialized part now, as "rank<r>/<name>"; only its write
// can wait.
void gather_single_file(Save& save, const data::SafetensorsFile& mine, const char* op) {
  const dist::Group& group = save.group;
  std::vector<std::string> images =
      detail::gather_bytes(data::serialize_safetensors(mine.tensors, mine.metadata), 0, group);
  detail::run_together(op, group, "gather the checkpoint", [&] {
    for (size_t r = 0; r < images.size(); ++r) {
      const data::SafetensorsFile contents = data::parse_safetensors(
          images[r].data(), images[r].size(), fmt::format("rank {}'s contents", r));
      std::string().swap(images[r]);
      for (const auto& [name, t] : contents.tensors)
        save.contents.tensors.emplace_back(fmt::format("rank{}/{}", r, name), t);
      for (const auto& [key, value] : contents.metadata)
        save.contents.metadata[fmt::format("rank{}/{}", r, key)] = value;
    }
    if (group.rank() == 0) save.contents.metadata[detail::kSaveIdKey] = save.save_id;
  });
}

// Hands the save to its writer thread; the job's finalize completes it if nothing else does.
void write_in_background(std::unique_ptr<Save> save) {
  static bool hooked_this_init = false;  // reset by the hook itself
  if (!hooked_this_init) {
    hooked_this_init = true;
    dist::at_finalize([] {
      hooked_this_init = false;
      // Dropped as the hook ends, whether the commit raised or not (a pending save holds its
      // own handle to the group it commits on).
      std::map<std::vector<int>, dist::Group> groups;
      {
        std::lock_guard lock(commit_groups_mutex);
        groups.swap(commit_groups);
      }
      complete_pending();
    });
  }
  save->commit_group = commit_group_for(save->group);
  Save* raw = save.get();
  raw->writer = std::thread([raw] { write_and_commit(*raw); });
  std::lock_guard lock(pending_mutex);
  pending = std::move(save);
}

}  // namespace

void save_sharded_checkpoint(const std::string& dir, const data::TrainingState& state,
                             const dist::Group& group, ShardedCheckpointOptions options) {
  const char* op = "save_sharded_checkpoint";
  const dist::KeepAlive alive;  // a synchronous save's writes may outlast --hang-timeout
  complete_pending();
  auto save = std::make_unique<Save>();
  save->dir = dir;
  save->group = group;
  save->commit_group = group;
  save->single_file = options.single_file;
  const int size = group.size();
  WEAVE_CHECK(group.rank() >= 0, op, "this rank is not in group {}", group.str());
  check_same_directory(dir, group, op);
  prepare_save(*save, op);

  data::TrainingState recorded = state;  // with what a reproducible run must keep
  detail::record_reproducible_run(recorded.user);
  data::SafetensorsFile mine = data::checkpoint_contents(recorded);
  mine.metadata["weave.placement"] = detail::pieces_text(detail::pieces_of(state));
  mine.metadata[detail::kSaveIdKey] = save->save_id;
  if (!options.single_file) {
    for (int r = 0; r < size; ++r) save->files.push_back(shard_name(r, size, save->generation));
    save->contents = options.async ? host_copy(std::move(mine)) : std::move(mine);
  } else {
    save->files.push_back(fmt::format("all-{:05d}-ranks.g{}.safetensors", size, save->generation));
    gather_single_file(*save, mine, op);
  }
  if (!options.async) {
    write_files(*save);
    commit(*save);
    return;
  }
  write_in_background(std::move(save));
}

void wait_for_checkpoint() {
  complete_pending();
}

namespace {

// Restores `contents` on every rank of the group or on none: each rank checks its own, then
// learns whether every rank's checks passed before anything changes. `read` (which may raise
// too) comes first.
void restore_everywhere(const std::function<data::SafetensorsFile()>& read,
                        data::TrainingState& state, const std::string& name, const std::string& dir,
                        const dist::Group& group) {
  bool agreed = false;
  try {
    data::restore_checkpoint(read(), state, name, [&] {
      agreed = true;
      WEAVE_CHECK(detail::all_agree(true, group), "load_sharded_checkpoint",
                  "another rank of group {} could not load its part of {}; nothing was changed "
                  "here",
                  group.str(), dir);
    });
  } catch (...) {
    if (!agreed) detail::all_agree(false, group);  // this rank's own check failed: tell the others
    throw;
  }
}

// A checkpoint without placements (format 1): each rank restores its own part whole.
void load_own_parts(const detail::CheckpointIndex& index, const std::string& dir,
                    data::TrainingState& state, const dist::Group& group) {
  const int rank = group.rank(), size = group.size();
  const bool single = index.single_file;
  std::string path = dir;  // the file, once the sizes are known to match (names it in errors)
  restore_everywhere(
      [&] {
        const int saved_size = index.world_size;
        WEAVE_CHECK(saved_size == size, "load_sharded_checkpoint",
                    "{} was saved by {} ranks in format {}, which records no placements, and "
                    "this group has {}; hint: load it at the world size it was saved at and save "
                    "it again",
                    dir, saved_size, detail::kCheckpointFormatWithoutPlacements, size);
        path = dir + "/" + index.files[single ? 0 : size_t(rank)];
        data::SafetensorsFile contents = data::load_safetensors(path);
        return single ? rank_part(contents, rank) : contents;
      },
      state, path, dir, group);
}

}  // namespace

ShardedLoadReport load_sharded_checkpoint(const std::string& dir, data::TrainingState& state,
                                          const dist::Group& group) {
  const char* op = "load_sharded_checkpoint";
  const dist::KeepAlive alive;  // its reads may outlast --hang-timeout
  complete_pending();           // a save still being written is the newest
  const int rank = group.rank(), size = group.size();
  WEAVE_CHECK(rank >= 0, op, "this rank is not in group {}", group.str());
  ShardedLoadReport report;
  // 1. Local: the index, every file's header, the plan of this rank's reads.
  detail::CheckpointIndex index;
  std::vector<detail::SavedPart> parts;
  detail::LoadPlan plan;
  std::vector<std::string> saved;
  detail::run_together(
      op, group, fmt::format("plan its part of {}; nothing was changed here", dir), [&] {
        index = detail::read_checkpoint_index(dir);
        report.saved_world_size = index.world_size;
        if (!index.has_placements()) return;
        const auto headers = detail::read_checkpoint_headers(dir, index);
        for (const auto& header : headers) report.bytes_read += int64_t(header->bytes_read);
        parts = detail::saved_parts(headers, index.single_file, report.saved_world_size);
        plan = detail::plan_load(parts, state, rank, size, dir);
        saved = detail::saved_globals(parts);
      });
  if (!index.has_placements()) {
    load_own_parts(index, dir, state, group);
    detail::check_reproducible_run(state.user, op);
    return report;
  }
  // 2. Every tensor the checkpoint holds must be taken by some rank, or it is another model's
  // (every rank read the same headers, so all decide alike).
  WEAVE_CHECK(detail::value_range({int64_t(saved.size())}, group).same(0), op,
              "the ranks of group {} read different files in {} (was it replaced meanwhile?); "
              "nothing was changed",
              group.str(), dir);
  // A part that no rank restores (the optimizer's state in a model-only load) is left alone.
  auto restored = [&](const std::string& tensor) {
    if (tensor.rfind("optimizer/", 0) == 0) return state.optimizer != nullptr;
    if (tensor.rfind("loader/", 0) == 0) return state.loader != nullptr;
    return true;
  };
  std::vector<int64_t> any(saved.size(), 0);
  for (size_t i = 0; i < saved.size(); ++i)
    any[i] =
        !restored(saved[i]) || std::binary_search(plan.wanted.begin(), plan.wanted.end(), saved[i])
            ? 1
            : 0;
  any = dist::agree_max(std::move(any), group);
  for (size_t i = 0; i < saved.size(); ++i)
    WEAVE_CHECK(any[i] == 1, op,
                "{} holds '{}', which nothing being restored on any rank takes; nothing was "
                "changed; hint: is it a checkpoint of this model? pass the same parts (model, "
                "optimizer) as when saving",
                dir, saved[i]);
  // 3. Read (verifying checksums) and restore, all or nothing across the group.
  restore_everywhere(
      [&] {
        report.bytes_read += detail::read_planned(plan);
        report.bytes_needed = plan.bytes_needed;
        return std::move(plan.contents);
      },
      state, dir, dir, group);
  detail::check_reproducible_run(state.user, op);
  return report;
}

bool resume_from_latest(const std::string& dir, data::TrainingState& state,
                        const dist::Group& group) {
  complete_pending();
  // Group rank 0 decides, so that every rank takes the same branch even while a save's files
  // appear on a shared file system.
  Tensor found = full({1}, fs::exists(fs::path(dir) / "index.json") ? 1.0 : 0.0, {.dtype = kInt32});
  dist::broadcast(found, 0, group);
  if (found.item<int32_t>() == 0) return false;
  load_sharded_checkpoint(dir, state, group);
  return true;
}

}  // namespace weave::parallel
