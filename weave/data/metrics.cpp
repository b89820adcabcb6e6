// Progress lines and the JSON Lines metrics file (metrics.h).
#include "weave/data/metrics.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <utility>

#include "weave/data/tensorboard.h"
#include "weave/tensor/error.h"
#include "weave/tensor/process.h"
#include "weave/tensor/storage.h"

namespace weave::data {

namespace {

using json = nlohmann::json;

// "1h02m", "3m05s", "42s".
std::string duration_text(double seconds) {
  const int64_t s = int64_t(std::llround(std::max(0.0, seconds)));
  if (s >= 3600) return fmt::format("{}h{:02}m", s / 3600, (s % 3600) / 60);
  if (s >= 60) return fmt::format("{}m{:02}s", s / 60, s % 60);
  return fmt::format("{}s", s);
}

// A derived value (throughput, ETA) only when known.
void put(json& record, const char* key, double value) {
  if (std::isfinite(value)) record[key] = value;
}

// A value the caller gave: JSON has no NaN or infinity, so those go in as strings.
void put(json& record, const char* key, const std::optional<double>& value) {
  if (!value) return;
  if (std::isfinite(*value))
    record[key] = *value;
  else
    record[key] = std::isnan(*value) ? "nan" : *value > 0 ? "inf" : "-inf";
}

// The record's line; a name that is not valid UTF-8 raises weave::Error.
std::string dumped(const json& record) {
  try {
    return record.dump();
  } catch (const json::exception& e) {
    WEAVE_FAIL("MetricsLogger",
               "cannot write the record of step {}: {}; hint: metric names must be valid UTF-8",
               record.value("step", int64_t(-1)), e.what());
  }
}

// The whole lines of the file at fd (read from its start) that a run resumed after `step` keeps:
// those of records at or before it. A line that does not parse (cut by a kill) goes too.
std::string records_up_to(int fd, int64_t step) {
  std::string text;
  char buffer[65536];
  for (ssize_t got; (got = ::pread(fd, buffer, sizeof buffer, off_t(text.size()))) > 0;)
    text.append(buffer, size_t(got));
  std::string kept;
  for (size_t begin = 0, end; begin < text.size(); begin = end + 1) {
    end = text.find('\n', begin);
    if (end == std::string::npos) break;  // the last line was cut
    const std::string line = text.substr(begin, end - begin);
    const json record = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (record.is_discarded() || !record.is_object()) continue;
    const auto at = record.find("step");
    if (at == record.end() || !at->is_number_integer() || at->get<int64_t>() <= step)
      kept += line + "\n";
  }
  return kept;
}

std::string shown(const char* name, const std::optional<double>& value, const char* format) {
  return value ? fmt::format(" {} ", name) + fmt::format(fmt::runtime(format), *value) : "";
}

}  // namespace

double transformer_flops_per_token(int64_t parameters, int64_t layers, int64_t dim,
                                   int64_t context) {
  WEAVE_CHECK(parameters >= 0 && layers >= 0 && dim >= 0 && context >= 0,
              "transformer_flops_per_token",
              "expected sizes >= 0, found parameters {}, layers {}, dim {}, context {}", parameters,
              layers, dim, context);
  return 6.0 * double(parameters) + 12.0 * double(layers) * double(context) * double(dim);
}

MetricsLogger::MetricsLogger(MetricsOptions options)
    : options_(std::move(options)), start_(std::chrono::steady_clock::now()), last_(start_) {
  if (!options_.enabled) return;
  for (const auto& [name, value] : {std::pair{"flops_per_token", options_.flops_per_token},
                                    std::pair{"peak_flops", options_.peak_flops}})
    WEAVE_CHECK(std::isfinite(value) && value >= 0, "MetricsLogger",
                "{} must be a finite number >= 0 (0: no MFU), found {}", name, value);
  terminal_ = options_.progress && ::isatty(STDERR_FILENO) == 1;
  if (!options_.tensorboard_dir.empty())
    board_ = std::make_unique<TensorBoardWriter>(options_.tensorboard_dir);
  if (options_.path.empty()) return;
  // Locked before it is emptied: a second writer of the same file must not wipe the first's
  // records, nor interleave its lines with them.
  const int fd = ::open(options_.path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
  WEAVE_CHECK(fd >= 0, "MetricsLogger", "cannot open {} for writing: {}", options_.path,
              std::strerror(errno));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    ::close(fd);
    WEAVE_FAIL("MetricsLogger",
               "{} is being written by another MetricsLogger (in this process or another); "
               "hint: one writer per file: enable the logger on one rank only, or give each "
               "run its own path",
               options_.path);
  }
  struct stat info;
  const bool regular = ::fstat(fd, &info) == 0 && S_ISREG(info.st_mode);  // not /dev/full
  const std::string kept = regular && options_.start_step > 0 && !options_.replace
                               ? records_up_to(fd, options_.start_step)
                               : std::string();
  if ((regular && ::ftruncate(fd, 0) != 0) || (file_ = ::fdopen(fd, "w")) == nullptr) {
    const int saved = errno;
    ::close(fd);
    WEAVE_FAIL("MetricsLogger", "cannot open {} for writing: {}", options_.path,
               std::strerror(saved));
  }
  if (!kept.empty()) {
    const bool written =
        std::fwrite(kept.data(), 1, kept.size(), file_) == kept.size() && std::fflush(file_) == 0;
    if (!written) {
      const int saved = errno;
      std::fclose(std::exchange(file_, nullptr));
      WEAVE_FAIL("MetricsLogger",
                 "cannot write the {} bytes of records a resumed run keeps to {}: {}", kept.size(),
                 options_.path, std::strerror(saved));
    }
  }
}

void MetricsLogger::board(const std::string& tag, double value, int64_t step) {
  if (board_ && std::isfinite(value)) board_->add_scalar(tag, value, step);
}

MetricsLogger::~MetricsLogger() {
  if (line_open_) std::fputc('\n', stderr);
  if (file_) std::fclose(file_);
}

void MetricsLogger::write(const std::string& record) {
  const std::string line = record + "\n";
  if (!file_) return;
  const long before = std::ftell(file_);
  // Flushed per record: a killed run keeps what it logged.
  const bool written =
      std::fwrite(line.data(), 1, line.size(), file_) == line.size() && std::fflush(file_) == 0;
  if (written) return;
  const int why = errno;
  // Whole lines only: what part of this record reached the file is cut back off.
  std::clearerr(file_);
  const bool cut = before >= 0 && ::ftruncate(::fileno(file_), before) == 0 &&
                   std::fseek(file_, before, SEEK_SET) == 0;
  WEAVE_FAIL("MetricsLogger", "cannot write to {}: {}; this record is lost{}; hint: free space",
             options_.path, std::strerror(why), cut ? "" : " and the last line may be cut");
}

namespace {

// This process's own figures, when the caller gives no group's.
MemoryPeaks own_memory(Device device) {
  const MemoryStats stats = memory_stats(device);
  return {.tensor_peak = stats.peak,
          .tensor_rank = process_place().rank,
          .resident_peak = stats.resident_peak,
          .resident_rank = process_place().rank};
}

}  // namespace

void MetricsLogger::log_step(const StepMetrics& m) {
  if (!options_.enabled) return;
  const auto now = std::chrono::steady_clock::now();
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const double since = std::chrono::duration<double>(now - last_).count();
  last_ = now;
  const double throughput = m.tokens > 0 && since > 0 ? double(m.tokens) / since : NAN;
  const int64_t done = m.step - options_.start_step, total = options_.total_steps;
  const double eta = total > 0 && done > 0 ? elapsed / double(done) * double(total - m.step) : NAN;
  const MemoryPeaks memory = m.memory.value_or(own_memory(options_.device));
  const double peak_mb = double(memory.tensor_peak) / 1e6;
  const double resident_mb = double(memory.resident_peak) / 1e6;
  const double mfu = options_.flops_per_token > 0 && options_.peak_flops > 0
                         ? throughput * options_.flops_per_token / options_.peak_flops
                         : NAN;
  json record = {{"kind", "train"}, {"step", m.step}};
  put(record, "loss", m.loss);
  put(record, "lr", m.lr);
  put(record, "tokens_per_s", throughput);
  put(record, "mfu", mfu);
  put(record, "grad_norm", m.grad_norm);
  put(record, "peak_mb", peak_mb);
  put(record, "resident_mb", resident_mb);
  if (m.memory) {
    record["peak_rank"] = memory.tensor_rank;
    record["resident_rank"] = memory.resident_rank;
  }
  put(record, "elapsed_s", elapsed);
  put(record, "eta_s", eta);
  write(dumped(record));
  for (const auto& [tag, value] : {std::pair{"train/loss", m.loss.value_or(NAN)},
                                   {"train/lr", m.lr.value_or(NAN)},
                                   {"train/tokens_per_s", throughput},
                                   {"train/mfu", mfu},
                                   {"train/grad_norm", m.grad_norm.value_or(NAN)},
                                   {"train/peak_mb", peak_mb},
                                   {"train/resident_mb", resident_mb}})
    board(tag, value, m.step);
  if (!options_.progress) return;
  std::string line =
      total > 0 ? fmt::format("step {}/{}", m.step, total) : fmt::format("step {}", m.step);
  line += shown("loss", m.loss, "{:.4f}") + shown("lr", m.lr, "{:.2e}");
  if (std::isfinite(throughput)) line += fmt::format(" tokens/s {:.0f}", throughput);
  if (std::isfinite(mfu)) line += fmt::format(" mfu {:.1f}%", 100 * mfu);
  line += shown("grad_norm", m.grad_norm, "{:.3f}");
  line += m.memory ? fmt::format(" peak {:.0f} MB (rank {}) resident {:.0f} MB (rank {})", peak_mb,
                                 memory.tensor_rank, resident_mb, memory.resident_rank)
                   : fmt::format(" peak {:.0f} MB resident {:.0f} MB", peak_mb, resident_mb);
  if (std::isfinite(eta)) line += " eta " + duration_text(eta);
  if (terminal_ && total > 0) {
    const int width = 24, filled = int(width * std::min<int64_t>(m.step, total) / total);
    std::fprintf(stderr, "\r[%s%s] %s\033[K", std::string(size_t(filled), '#').c_str(),
                 std::string(size_t(width - filled), '.').c_str(), line.c_str());
    line_open_ = true;
  } else {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
  std::fflush(stderr);
}

void MetricsLogger::log_eval(int64_t step, const std::string& name, double value) {
  if (!options_.enabled) return;
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  json record = {{"kind", "eval"}, {"step", step}, {"name", name}};
  put(record, "value", std::optional<double>(value));
  put(record, "elapsed_s", elapsed);
  write(dumped(record));
  board("eval/" + name, value, step);
  if (!options_.progress) return;
  if (line_open_) std::fputc('\n', stderr);
  line_open_ = false;
  std::fprintf(stderr, "step %lld %s %.4f\n", static_cast<long long>(step), name.c_str(), value);
  std::fflush(stderr);
}

void MetricsLogger::log_values(int64_t step, const std::string& kind,
                               const std::vector<std::pair<std::string, double>>& values) {
  if (!options_.enabled) return;
  json record = {{"kind", kind}, {"step", step}}, named = json::object();
  for (const auto& [name, value] : values) {
    put(named, name.c_str(), std::optional<double>(value));
    board(kind + "/" + name, value, step);
  }
  record["values"] = named;
  write(dumped(record));
}

}  // namespace weave::data
