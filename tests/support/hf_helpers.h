#pragma once
// Scratch copies of the Hugging Face reference checkpoints (tests/data/hf) for the tests that
// edit, break or export them; this process's scratch folders go when the tests end.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

namespace weave_test {

namespace fs = std::filesystem;

inline std::string reference_dir(const std::string& arch) {
  return std::string(WEAVE_TEST_DATA_DIR) + "/hf/" + arch;
}

inline fs::path scratch_root() {
  return fs::temp_directory_path() / ("weave_hf_" + std::to_string(::getpid()));
}

struct ScratchCleanup {
  ~ScratchCleanup() {
    std::error_code ignored;
    fs::remove_all(scratch_root(), ignored);
  }
};
inline ScratchCleanup scratch_cleanup;

// An empty path `name` under this process's scratch root.
inline fs::path scratch(const std::string& name) {
  const auto dir = scratch_root() / name;
  fs::remove_all(dir);
  fs::create_directories(dir.parent_path());
  return dir;
}

inline void copy_checkpoint(const std::string& from, const fs::path& to) {
  fs::create_directories(to);
  for (const auto& entry : fs::directory_iterator(from))
    fs::copy_file(entry.path(), to / entry.path().filename());
}

inline void edit_config(const fs::path& dir, const std::function<void(nlohmann::json&)>& edit) {
  auto config = nlohmann::json::parse(std::ifstream(dir / "config.json"));
  edit(config);
  std::ofstream(dir / "config.json") << config.dump();
}

}  // namespace weave_test
