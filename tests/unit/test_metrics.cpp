// The metrics a dashboard reads: TensorBoard event files (their record framing and CRC-32C
// against known values, every scalar read back), and the model FLOPs utilization on the line
// and in the records.
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>

#include "helpers.h"
#include "weave/data/files.h"
#include "weave/data/tensorboard.h"

using namespace weave;

namespace {

// A protocol-buffer reader for the few fields an Event holds: field -> (wire type, bytes).
struct Field {
  int wire;
  std::string bytes;  // varint: its value as 8 bytes; fixed: its bytes; length-delimited: them
};
std::multimap<int, Field> fields(const std::string& message) {
  std::multimap<int, Field> out;
  size_t at = 0;
  auto varint = [&] {
    uint64_t v = 0;
    for (int shift = 0;; shift += 7) {
      const auto b = uint8_t(message.at(at++));
      v |= uint64_t(b & 0x7F) << shift;
      if (!(b & 0x80)) return v;
    }
  };
  while (at < message.size()) {
    const uint64_t key = varint();
    const int wire = int(key & 7), field = int(key >> 3);
    std::string bytes;
    if (wire == 0) {
      const uint64_t v = varint();
      bytes.assign(reinterpret_cast<const char*>(&v), 8);
    } else {
      const size_t n = wire == 1 ? 8 : wire == 5 ? 4 : size_t(varint());
      bytes = message.substr(at, n);
      at += n;
    }
    out.insert({field, {wire, bytes}});
  }
  return out;
}

template <class T>
T as(const std::string& bytes) {
  T value;
  std::memcpy(&value, bytes.data(), sizeof(T));
  return value;
}

// The events of an event file, each record's two checksums verified.
std::vector<std::string> events_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string data((std::istreambuf_iterator<char>(in)), {});
  std::vector<std::string> events;
  for (size_t at = 0; at < data.size();) {
    const std::string length_bytes = data.substr(at, 8);
    const auto length = as<uint64_t>(length_bytes);
    CHECK(as<uint32_t>(data.substr(at + 8, 4)) == data::detail::masked_crc32c(length_bytes));
    const std::string event = data.substr(at + 12, length);
    CHECK(as<uint32_t>(data.substr(at + 12 + length, 4)) == data::detail::masked_crc32c(event));
    events.push_back(event);
    at += 16 + length;
  }
  return events;
}

}  // namespace

TEST_SUITE("data") {
  TEST_CASE("TensorBoard event files: CRC-32C's check value, records, every scalar read back") {
    // CRC-32C (iSCSI, RFC 3720) of "123456789" is 0xE3069283; of 32 zero bytes 0x8A9136AA.
    CHECK(data::detail::crc32c("123456789") == 0xE3069283u);
    CHECK(data::detail::crc32c(std::string(32, '\0')) == 0x8A9136AAu);
    const auto dir =
        std::filesystem::temp_directory_path() / ("weave_board_" + std::to_string(::getpid()));
    {
      data::MetricsLogger metrics({.total_steps = 2,
                                   .progress = false,
                                   .flops_per_token = 6e6,
                                   .peak_flops = 1e12,
                                   .tensorboard_dir = dir.string()});
      metrics.log_step({.step = 1, .loss = 2.5, .lr = 1e-3, .tokens = 4096, .grad_norm = 0.5});
      metrics.log_eval(1, "heldout_loss", 2.75);
      metrics.log_values(1, "routing", {{"blocks.0.moe/max_load", 1.25}});
    }
    std::vector<std::string> files;
    for (const auto& entry : std::filesystem::directory_iterator(dir))
      files.push_back(entry.path().string());
    REQUIRE(files.size() == 1);
    CHECK(files[0].find("events.out.tfevents.") != std::string::npos);
    const std::vector<std::string> events = events_of(files[0]);
    REQUIRE(events.size() >= 3);
    const auto first = fields(events[0]);
    CHECK(first.find(3)->second.bytes == "brain.Event:2");     // file_version
    std::map<std::string, std::pair<int64_t, float>> scalars;  // tag -> (step, value)
    for (size_t i = 1; i < events.size(); ++i) {
      const auto event = fields(events[i]);
      CHECK(as<double>(event.find(1)->second.bytes) > 1.7e9);  // wall time, seconds since 1970
      const auto step = as<int64_t>(event.find(2)->second.bytes);
      const auto value = fields(fields(event.find(5)->second.bytes).find(1)->second.bytes);
      scalars[value.find(1)->second.bytes] = {step, as<float>(value.find(2)->second.bytes)};
    }
    CHECK(scalars.at("train/loss") == std::pair<int64_t, float>{1, 2.5f});
    CHECK(scalars.at("train/lr") == std::pair<int64_t, float>{1, 1e-3f});
    CHECK(scalars.at("train/grad_norm") == std::pair<int64_t, float>{1, 0.5f});
    CHECK(scalars.at("eval/heldout_loss") == std::pair<int64_t, float>{1, 2.75f});
    CHECK(scalars.at("routing/blocks.0.moe/max_load") == std::pair<int64_t, float>{1, 1.25f});
    // MFU is tokens/s x FLOPs per token over the peak: both from the same record.
    const float throughput = scalars.at("train/tokens_per_s").second;
    CHECK(scalars.at("train/mfu").second == doctest::Approx(throughput * 6e6 / 1e12));
    std::filesystem::remove_all(dir);
    CHECK(data::transformer_flops_per_token(1000, 2, 8, 16) == 6000 + 12 * 2 * 16 * 8);
  }

  TEST_CASE("two TensorBoard writers on one directory in one second write two files") {
    const auto dir =
        std::filesystem::temp_directory_path() / ("weave_boards_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir);
    {
      data::TensorBoardWriter first(dir.string()), second(dir.string());
      CHECK(first.path() != second.path());
      first.add_scalar("a", 1.0, 1);
      second.add_scalar("b", 2.0, 1);
    }
    int files = 0;
    for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(dir)) ++files;
    CHECK(files == 2);
    std::filesystem::remove_all(dir);
  }

  TEST_CASE("MFU's inputs must be finite sizes") {
    for (const double peak :
         {std::numeric_limits<double>::infinity(), -1.0, std::numeric_limits<double>::quiet_NaN()})
      CHECK_THROWS_WITH_AS(data::MetricsLogger({.progress = false, .peak_flops = peak}),
                           doctest::Contains("peak_flops must be a finite number"), Error);
    CHECK_THROWS_WITH_AS(data::MetricsLogger({.progress = false, .flops_per_token = -6e6}),
                         doctest::Contains("flops_per_token must be a finite number"), Error);
    CHECK_THROWS_WITH_AS(data::transformer_flops_per_token(-1, 2, 8, 16),
                         doctest::Contains("expected sizes >= 0"), Error);
    CHECK_THROWS_AS(data::transformer_flops_per_token(1000, 2, 8, -16), Error);
  }

  TEST_CASE("AtomicFileWriter::write_at overwrites what was written, and nothing past it") {
    const auto path = std::filesystem::temp_directory_path() /
                      ("weave_write_at_" + std::to_string(::getpid()) + ".bin");
    data::AtomicFileWriter out(path.string());
    out.write("abcdef", 6);
    out.write_at("XY", 2, 4);
    CHECK_THROWS_WITH_AS(out.write_at("XY", 2, 5), doctest::Contains("reaches past the 6 bytes"),
                         Error);
    CHECK_THROWS_AS(out.write_at("X", 1, uint64_t(-1)), Error);  // an offset that wraps
    out.commit();
    std::ifstream in(path, std::ios::binary);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    CHECK(text == "abcdXY");
    std::filesystem::remove(path);
  }
}
