#pragma once
// Progress and metrics for a training loop: a human line per logged step on stderr (a bar with
// the ETA, rewritten in place, when stderr is a terminal; plain lines when it is not, as in a
// log file) and a JSON Lines file with one record per logged step or evaluation, for plots
// (tools/weave-plot) and for other programs.
//
//   data::MetricsLogger metrics({.path = "run/metrics.jsonl", .enabled = dist::rank() == 0,
//                                .total_steps = steps});
//   for (int64_t step = 1; step <= steps; ++step) {
//     ...
//     metrics.log_step({.step = step, .loss = loss, .lr = lr, .tokens = batch_tokens,
//                       .grad_norm = norm});
//     if (step % 100 == 0) metrics.log_eval(step, "heldout_loss", heldout);
//   }
//
// The file's schema, one JSON object per line (fields that were not given are left out):
//   {"kind": "train", "step": 120, "loss": 2.314, "lr": 0.0008, "tokens_per_s": 12345.6,
//    "mfu": 0.412, "grad_norm": 0.93, "peak_mb": 123.4, "resident_mb": 250.1, "peak_rank": 0,
//    "resident_rank": 3, "elapsed_s": 61.2, "eta_s": 244.8}
//   {"kind": "eval", "step": 100, "name": "heldout_loss", "value": 2.41, "elapsed_s": 50.1}
//   {"kind": "routing", "step": 120, "values": {"blocks.0.moe/max_load": 1.12, ...}}
// "loss" is what the caller passes (typically the mean over the steps since the last record),
// tokens_per_s counts the tokens passed since the last record over the time since then, and
// peak_mb is the tensor peak (memory_stats(device).peak) and resident_mb the process's resident
// peak, this rank's, or the worst rank's with StepMetrics::memory (then with their ranks). A
// fresh run (start_step 0) replaces the file; a resumed
// run (start_step > 0) keeps its records up to start_step, drops the later ones (logged after
// the checkpoint it resumed from, by the run that died), and appends, so that the file of a
// run killed and resumed any number of times reads as one run's. Each record is flushed as it
// is written. A record that cannot be written whole (a full disk) is
// cut back off the file, which keeps only whole lines, and the call raises weave::Error; so
// does a metric name that is not valid UTF-8.
//
// With flops_per_token and peak_flops the line and the records carry the model FLOPs
// utilization (PaLM's MFU: tokens/s x FLOPs per token / the hardware's peak;
// transformer_flops_per_token gives the first). With tensorboard_dir the same numbers go to a
// TensorBoard event file there (train/loss, train/lr, ..., eval/<name>).
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "weave/tensor/device.h"
#include "weave/tensor/process_memory.h"

namespace weave::data {

struct MetricsOptions {
  /// The JSON Lines file ("": none).
  std::string path = {};
  /// Log on this process: pass `dist::rank() == 0` so that one rank speaks for the job.
  bool enabled = true;
  /// For the bar and the ETA (0: unknown).
  int64_t total_steps = 0;
  /// The step this run starts after (a resumed run's): for the ETA's pace, and, above 0, the
  /// last step whose records the file keeps.
  int64_t start_step = 0;
  /// Replace the file even when start_step > 0.
  bool replace = false;
  /// Print the human line (on stderr).
  bool progress = true;
  /// Whose peak memory the records report.
  Device device = kCPU;
  /// Training FLOPs per token of the model and the job's peak FLOP/s (every device's, summed):
  /// both set, each logged step reports its model FLOPs utilization.
  double flops_per_token = 0, peak_flops = 0;
  /// A directory for TensorBoard's event files ("": none).
  std::string tensorboard_dir = {};
};

/// A decoder-only transformer's training FLOPs per token (forward and backward), PaLM's
/// estimate: 6 N for the parameters' products, plus 12 layers x context x dim for attention's.
double transformer_flops_per_token(int64_t parameters, int64_t layers, int64_t dim,
                                   int64_t context);

class TensorBoardWriter;

/// One logged step. Leave a field unset to leave it out; a NaN or infinite value is recorded as
/// "nan", "inf" or "-inf" (a diverging run shows in the file and on the line).
struct StepMetrics {
  int64_t step = 0;
  std::optional<double> loss = std::nullopt;
  std::optional<double> lr = std::nullopt;
  /// Tokens (or examples) processed since the previous record, for the throughput.
  int64_t tokens = 0;
  std::optional<double> grad_norm = std::nullopt;
  /// The worst rank's memory (dist::max_memory_stats over the job, called on every rank): the
  /// record's peak_mb and resident_mb are then its, with peak_rank and resident_rank. Unset:
  /// this process's own (memory_stats(device): tensor peak and resident peak).
  std::optional<MemoryPeaks> memory = std::nullopt;
};

class MetricsLogger {
 public:
  explicit MetricsLogger(MetricsOptions options);
  ~MetricsLogger();
  MetricsLogger(const MetricsLogger&) = delete;
  MetricsLogger& operator=(const MetricsLogger&) = delete;

  void log_step(const StepMetrics& metrics);
  void log_eval(int64_t step, const std::string& name, double value);
  /// A step's named values beside its loss (nn::routing_metrics: each mixture of experts'
  /// busiest expert over the mean load, and its dropped share): one record {"kind": kind,
  /// "step": 120, "values": {name: value, ...}} and TensorBoard's "<kind>/<name>"; nothing on
  /// the human line.
  void log_values(int64_t step, const std::string& kind,
                  const std::vector<std::pair<std::string, double>>& values);

 private:
  void write(const std::string& record);
  void board(const std::string& tag, double value, int64_t step);
  MetricsOptions options_;
  std::unique_ptr<TensorBoardWriter> board_;
  std::FILE* file_ = nullptr;
  bool terminal_ = false;
  bool line_open_ = false;  // a bar is on the terminal's last line
  std::chrono::steady_clock::time_point start_, last_;
};

}  // namespace weave::data
