#include "weave/data/tensorboard.h"

#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "weave/tensor/error.h"

namespace weave::data {

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Protocol-buffer wire format, the three field kinds an Event of scalars needs.
void varint(std::string& out, uint64_t v) {
  for (; v >= 0x80; v >>= 7) out.push_back(char(uint8_t(v) | 0x80));
  out.push_back(char(v));
}
void key(std::string& out, int field, int wire_type) {
  varint(out, uint64_t(field) << 3 | uint64_t(wire_type));
}
template <class T>
void fixed(std::string& out, int field, int wire_type, T value) {
  key(out, field, wire_type);
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));  // little-endian, as the wire format
  out.append(bytes, sizeof(T));
}
void bytes_field(std::string& out, int field, std::string_view bytes) {
  key(out, field, 2);
  varint(out, bytes.size());
  out.append(bytes);
}

// Event { double wall_time = 1; int64 step = 2; ... }
std::string event_head(double wall_time, int64_t step) {
  std::string event;
  fixed(event, 1, 1, wall_time);
  key(event, 2, 0);
  varint(event, uint64_t(step));
  return event;
}

}  // namespace

namespace detail {

uint32_t crc32c(std::string_view bytes) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = c & 1 ? 0x82F63B78u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t crc = 0xFFFFFFFFu;
  for (const char b : bytes) crc = table[(crc ^ uint8_t(b)) & 0xFF] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(std::string_view bytes) {
  const uint32_t crc = crc32c(bytes);
  return ((crc >> 15) | (crc << 17)) + 0xA282EAD8u;
}

std::string scalar_event(double wall_time, int64_t step, const std::string& tag, float value) {
  // Summary { repeated Value value = 1; }  Value { string tag = 1; float simple_value = 2; }
  std::string summary_value;
  bytes_field(summary_value, 1, tag);
  fixed(summary_value, 2, 5, value);
  std::string summary;
  bytes_field(summary, 1, summary_value);
  std::string event = event_head(wall_time, step);
  bytes_field(event, 5, summary);  // Event.summary
  return event;
}

std::string version_event(double wall_time) {
  std::string event = event_head(wall_time, 0);
  bytes_field(event, 3, "brain.Event:2");  // Event.file_version
  return event;
}

}  // namespace detail

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  char host[256] = "localhost";
  ::gethostname(host, sizeof host - 1);
  const std::string base =
      fmt::format("{}/events.out.tfevents.{}.{}.{}", dir, int64_t(now_s()), host, ::getpid());
  // A new file, never another writer's: a second writer on the directory in the same second
  // takes the next free suffix (TensorBoard's own writers count the same way).
  for (int suffix = 0; suffix < 1000; ++suffix) {
    path_ = suffix == 0 ? base : fmt::format("{}.{}", base, suffix);
    file_ = std::fopen(path_.c_str(), "wbx");
    if (file_ != nullptr || errno != EEXIST) break;
  }
  WEAVE_CHECK(file_ != nullptr, "TensorBoardWriter", "cannot create {}: {}", path_,
              std::strerror(errno));
  write_event(detail::version_event(now_s()));
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_) std::fclose(file_);
}

void TensorBoardWriter::add_scalar(const std::string& tag, double value, int64_t step) {
  write_event(detail::scalar_event(now_s(), step, tag, float(value)));
}

void TensorBoardWriter::write_event(const std::string& event) {
  std::string record;
  const uint64_t length = event.size();
  record.append(reinterpret_cast<const char*>(&length), 8);
  const uint32_t length_crc = detail::masked_crc32c(record);
  record.append(reinterpret_cast<const char*>(&length_crc), 4);
  record += event;
  const uint32_t event_crc = detail::masked_crc32c(event);
  record.append(reinterpret_cast<const char*>(&event_crc), 4);
  const bool written = std::fwrite(record.data(), 1, record.size(), file_) == record.size() &&
                       std::fflush(file_) == 0;
  WEAVE_CHECK(written, "TensorBoardWriter", "cannot write to {}: {}", path_, std::strerror(errno));
}

}  // namespace weave::data
