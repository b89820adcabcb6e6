#pragma once
// TensorBoard's event files, written directly (no TensorFlow, no protobuf library): scalars a
// run logs appear in `tensorboard --logdir DIR` as they would from PyTorch's SummaryWriter.
//
//   data::TensorBoardWriter board("runs/llama");
//   board.add_scalar("train/loss", 2.31, step);
//
// The file, events.out.tfevents.<seconds>.<host>.<pid>, is a sequence of records (TFRecord
// framing: length, masked CRC-32C of the length, a serialized tensorflow.Event, its masked
// CRC-32C), the first one naming the file version; each record is flushed as written.
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

namespace weave::data {

class TensorBoardWriter {
 public:
  /// Creates dir and a new event file in it.
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  void add_scalar(const std::string& tag, double value, int64_t step);
  const std::string& path() const { return path_; }

 private:
  void write_event(const std::string& event);
  std::string path_;
  std::FILE* file_ = nullptr;
};

namespace detail {
/// CRC-32C (Castagnoli) of bytes, and TFRecord's masked form of it.
uint32_t crc32c(std::string_view bytes);
uint32_t masked_crc32c(std::string_view bytes);
/// A serialized tensorflow.Event: wall_time, step, and either file_version or one scalar.
std::string scalar_event(double wall_time, int64_t step, const std::string& tag, float value);
std::string version_event(double wall_time);
}  // namespace detail

}  // namespace weave::data
