// The sharded checkpoint's index: written, read and checked in one place.
#include "weave/parallel/checkpoint/checkpoint_index.h"

#include <nlohmann/json.hpp>

#include "weave/data/files.h"
#include "weave/tensor/checksum.h"

namespace weave::parallel::detail {

namespace {

using json = nlohmann::json;
constexpr const char* kIndexOp = "load_sharded_checkpoint";

// Every field is checked for its type before it is read: a hand-edited or foreign index gets
// this error, not a JSON library's.
void check_index(bool ok, const std::string& path, const std::string& problem) {
  WEAVE_CHECK(ok, kIndexOp, "{} is not a loadable weave sharded checkpoint index: {}", path,
              problem);
}

bool plain_file_name(const json& f) {
  if (!f.is_string()) return false;
  const std::string name = f.get<std::string>();
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

void check_save_id(const data::Metadata& metadata, const std::string& path,
                   const CheckpointIndex& index) {
  if (index.save_id.empty()) return;
  auto found = metadata.find(kSaveIdKey);
  const std::string theirs = found == metadata.end() ? "none" : found->second;
  WEAVE_CHECK(theirs == index.save_id, kIndexOp,
              "{} belongs to another save (save id {}; the index's is {}): the directory mixes "
              "files of different saves; nothing was changed; hint: restore the directory whole "
              "from one save",
              path, theirs, index.save_id);
}

}  // namespace

std::string CheckpointIndex::dump() const {
  json index = {{"format", format},      {"world_size", world_size},   {"generation", generation},
                {"files", files},        {"single_file", single_file}, {"save_id", save_id},
                {"checksums", checksums}};
  return index.dump(2) + "\n";
}

CheckpointIndex read_checkpoint_index(const std::string& dir) {
  const std::string path = dir + "/index.json";
  const json j = json::parse(data::read_file(path), nullptr, false);
  check_index(!j.is_discarded() && j.is_object(), path, "not a JSON object");
  CheckpointIndex index;
  check_index(
      j.contains("format") && j["format"].is_string() &&
          (j["format"] == kCheckpointFormat || j["format"] == kCheckpointFormatWithoutPlacements),
      path,
      fmt::format("expected format {} or {}", kCheckpointFormat,
                  kCheckpointFormatWithoutPlacements));
  index.format = j["format"].get<std::string>();
  check_index(j.contains("world_size") && j["world_size"].is_number_integer() &&
                  j["world_size"].get<int64_t>() > 0 && j["world_size"].get<int64_t>() < (1 << 24),
              path, "expected a positive world_size");
  index.world_size = j["world_size"].get<int>();
  check_index(j.contains("generation") && j["generation"].is_number_integer() &&
                  j["generation"].get<int64_t>() >= 0,
              path, "expected a generation number");
  index.generation = j["generation"].get<int64_t>();
  if (j.contains("single_file")) {
    check_index(j["single_file"].is_boolean(), path, "single_file must be true or false");
    index.single_file = j["single_file"].get<bool>();
  }
  check_index(j.contains("files") && j["files"].is_array(), path, "expected a files list");
  for (const json& f : j["files"]) {
    check_index(plain_file_name(f), path,
                fmt::format("{} is not a plain file name in the directory", f.dump()));
    index.files.push_back(f.get<std::string>());
  }
  const size_t expected = index.single_file ? 1 : size_t(index.world_size);
  check_index(index.files.size() == expected, path,
              fmt::format("it lists {} files for {} ranks{}", index.files.size(), index.world_size,
                          index.single_file ? " in one file" : ""));
  if (j.contains("save_id")) {
    check_index(j["save_id"].is_string(), path, "save_id must be a string");
    index.save_id = j["save_id"].get<std::string>();
  }
  if (j.contains("checksums")) {
    const json& sums = j["checksums"];
    check_index(sums.is_array() && sums.size() == index.files.size(), path,
                "expected one checksum per file");
    for (const json& c : sums) {
      check_index(c.is_number_unsigned() && c.get<uint64_t>() <= 0xffffffffu, path,
                  "a checksum is not a CRC-32");
      index.checksums.push_back(c.get<uint32_t>());
    }
  }
  return index;
}

std::vector<std::shared_ptr<const data::SafetensorsHeader>> read_checkpoint_headers(
    const std::string& dir, const CheckpointIndex& index) {
  std::vector<std::shared_ptr<const data::SafetensorsHeader>> headers;
  for (const std::string& name : index.files) {
    auto header =
        std::make_shared<data::SafetensorsHeader>(data::read_safetensors_header(dir + "/" + name));
    check_save_id(header->metadata, header->path, index);
    headers.push_back(std::move(header));
  }
  return headers;
}

int64_t verify_checkpoint_files(const std::string& dir, const CheckpointIndex& index) {
  int64_t bytes = 0;
  for (size_t i = 0; i < index.files.size(); ++i) {
    const std::string path = dir + "/" + index.files[i];
    const std::string image = data::read_file(path);
    bytes += int64_t(image.size());
    if (!index.checksums.empty()) {
      const uint32_t found = checksum_bytes(image.data(), image.size());
      WEAVE_CHECK(found == index.checksums[i], kIndexOp,
                  "{} has CRC-32 {:08x}, but the index recorded {:08x}: the file changed or "
                  "belongs to another save",
                  path, found, index.checksums[i]);
    }
    const data::SafetensorsFile file = data::parse_safetensors(image.data(), image.size(), path);
    check_save_id(file.metadata, path, index);
  }
  return bytes;
}

}  // namespace weave::parallel::detail
