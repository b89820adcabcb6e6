#pragma once
// examples/gpt's command line (gpt.cpp's header comment lists the flags).
#include <weave/weave.h>

#include <optional>
#include <string>

namespace gpt {

using namespace weave;

struct Flags {
  std::string strategy = "ddp", data_dir = "/usr/share/games/fortunes", checkpoint, log;
  int tp = 2, threads = 1, samples = 3;
  int64_t layers = 4, dim = 256, heads = 4, context = 128, batch = 16, steps = 600,
          eval_every = 100, eval_windows = 64, checkpoint_every = 100, stop_at = -1, log_every = 20;
  double lr = 1e-3, min_lr = 1e-4, weight_decay = 0.01, clip = 1.0;
  int64_t warmup = 60;
  bool sequence_parallel = true, resume = false, checkpoint_activations = false;
  uint64_t seed = 0;
  std::optional<DType> autocast;
  std::string device = "cpu", backend;  // backend "": nccl for cuda, mpi for cpu
  Device placed = kCPU;                 // this rank's device (set once the runtime is up)
  int64_t vocab = 0;                    // at least the characters' count (a larger head)
};

inline Flags parse(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      WEAVE_CHECK(i + 1 < argc, "gpt", "{} needs a value", arg);
      return argv[++i];
    };
    if (arg == "--strategy")
      f.strategy = value();
    else if (arg == "--data")
      f.data_dir = value();
    else if (arg == "--checkpoint")
      f.checkpoint = value();
    else if (arg == "--log")
      f.log = value();
    else if (arg == "--tp")
      f.tp = std::stoi(value());
    else if (arg == "--threads")
      f.threads = std::stoi(value());
    else if (arg == "--samples")
      f.samples = std::stoi(value());
    else if (arg == "--layers")
      f.layers = std::stoll(value());
    else if (arg == "--dim")
      f.dim = std::stoll(value());
    else if (arg == "--heads")
      f.heads = std::stoll(value());
    else if (arg == "--context")
      f.context = std::stoll(value());
    else if (arg == "--batch")
      f.batch = std::stoll(value());
    else if (arg == "--steps")
      f.steps = std::stoll(value());
    else if (arg == "--warmup")
      f.warmup = std::stoll(value());
    else if (arg == "--log-every")
      f.log_every = std::stoll(value());
    else if (arg == "--eval-every")
      f.eval_every = std::stoll(value());
    else if (arg == "--eval-windows")
      f.eval_windows = std::stoll(value());
    else if (arg == "--checkpoint-every")
      f.checkpoint_every = std::stoll(value());
    else if (arg == "--stop-at")
      f.stop_at = std::stoll(value());
    else if (arg == "--lr")
      f.lr = std::stod(value());
    else if (arg == "--min-lr")
      f.min_lr = std::stod(value());
    else if (arg == "--seed")
      f.seed = std::stoull(value());
    else if (arg == "--device")
      f.device = value();
    else if (arg == "--backend")
      f.backend = value();
    else if (arg == "--vocab")
      f.vocab = std::stoll(value());
    else if (arg == "--resume")
      f.resume = true;
    else if (arg == "--no-sequence-parallel")
      f.sequence_parallel = false;
    else if (arg == "--checkpoint-activations")
      f.checkpoint_activations = true;
    else if (arg == "--autocast") {
      const std::string dtype = value();
      WEAVE_CHECK(dtype == "bf16" || dtype == "fp16", "gpt",
                  "--autocast must be bf16 or fp16, found '{}'", dtype);
      f.autocast = dtype == "bf16" ? kBFloat16 : kFloat16;
    } else
      WEAVE_FAIL("gpt",
                 "unknown flag '{}'; expected --strategy, --tp, --layers, --dim, --heads, "
                 "--context, --batch, --steps, --lr, --eval-every, --checkpoint, --resume, ...",
                 arg);
  }
  WEAVE_CHECK(f.device == "cpu" || f.device == "cuda", "gpt",
              "--device must be cpu or cuda, found '{}'", f.device);
  WEAVE_CHECK(f.backend.empty() || f.backend == "mpi" || f.backend == "nccl", "gpt",
              "--backend must be mpi or nccl, found '{}'", f.backend);
  WEAVE_CHECK(
      f.strategy == "ddp" || f.strategy == "fsdp" || f.strategy == "tp" || f.strategy == "hybrid",
      "gpt", "--strategy must be ddp, fsdp, tp or hybrid, found '{}'", f.strategy);
  return f;
}

}  // namespace gpt
