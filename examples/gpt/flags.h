#pragma once
// examples/gpt's command line (gpt.cpp's header comment lists the flags), and the checks that
// every rank was given the same one and that its axes fit the world.
#include <weave/weave.h>

#include <weave/util/cli.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

namespace gpt {

using namespace weave;

struct Flags {
  std::string strategy = "ddp", data_dir = "/usr/share/games/fortunes", checkpoint, log;
  std::string export_path;   // the trained model's whole state dict, as one safetensors file
  std::string arch = "gpt";  // gpt: GPT-2's blocks; llama: RMSNorm, rotary, GQA, SwiGLU
  int64_t kv_heads = 0;      // llama's key/value heads (0: as many as --heads)
  int64_t ffn = 0;           // llama's SwiGLU width (0: 8 dim / 3 rounded up to 64)
  bool pack = false;         // llama: each fortune its own document (end-of-text, positions)
  int tp = 0, threads = 1, samples = 3;
  int context_parallel = 1, expert_parallel = 1, pipeline = 1, microbatches = 0;
  int replicate = 1;  // fsdp: HSDP's replicas of shard groups (torchtitan's dp_replicate)
  int64_t experts = 0, top_k = 2;
  double expert_bias = 0;
  std::string cp_mode = "ring";
  int64_t layers = 4, dim = 256, heads = 4, context = 128, batch = 16, steps = 600,
          eval_every = 100, eval_windows = 64, checkpoint_every = 100, stop_at = -1, log_every = 20,
          kill_at = -1;
  double lr = 1e-3, min_lr = 1e-4, weight_decay = 0.01, clip = 1.0;
  int64_t warmup = 60;
  bool sequence_parallel = true, resume = false, checkpoint_activations = false;
  bool shard_vocabulary = true;  // ddp/fsdp: embedding and head split over the shard group
  bool reproducible = false;     // the same bits at any number of data-parallel ranks
  int64_t microbatch = 0;        // windows per micro-batch (0: each rank's share at once)
  bool cuda_graph = false;       // the training step as one CUDA graph
  bool verify_layout = false;    // check the layout against one process, then exit
  double peak_tflops = 0;        // one device's peak, for the MFU
  std::string tensorboard;       // TensorBoard's event files here
  std::string matmul_precision = "highest";  // float32 GEMMs: highest, or high (TF32)
  uint64_t seed = 0;
  std::optional<DType> autocast;
  std::optional<DType> param_dtype;     // fsdp's mixed-precision policy: gathered parameters
  std::string device = "cpu", backend;  // backend "": nccl for cuda, mpi for cpu
  Device placed = kCPU;                 // this rank's device (set once the runtime is up)
  int64_t vocab = 0;                    // at least the characters' count (a larger head)
};

// How the ranks split the model: the axes besides data parallelism.
inline void add_layout_options(CLI::App& app, Flags& f) {
  app.add_option("--tp", f.tp, "tensor-parallel group size (0: 2 under hybrid, else 1)")
      ->check(weave::cli::non_negative());
  app.add_flag("!--no-sequence-parallel", f.sequence_parallel,
               "tp/hybrid without sequence parallelism");
  app.add_flag("!--no-shard-vocabulary", f.shard_vocabulary,
               "ddp/fsdp: each rank holds the whole embedding and head (fsdp gathers them)");
  app.add_option("--context-parallel", f.context_parallel,
                 "ranks that split each sequence (zig-zag parts)")
      ->check(weave::cli::positive());
  app.add_option("--cp-mode", f.cp_mode, "attention across the context group")
      ->check(CLI::IsMember({"ring", "all-to-all"}));
  app.add_option("--experts", f.experts, "experts in each block's MLP (0: a dense MLP)")
      ->check(weave::cli::non_negative());
  app.add_option("--expert-parallel", f.expert_parallel, "ranks the experts are spread over")
      ->check(weave::cli::positive());
  app.add_option("--top-k", f.top_k, "experts each token goes to")->check(weave::cli::positive());
  app.add_option("--expert-bias", f.expert_bias,
                 "balance the experts by a selection bias moved this much a step, without the "
                 "auxiliary loss (DeepSeek-V3; 0: the auxiliary loss)")
      ->check(weave::cli::non_negative());
  app.add_option("--pipeline", f.pipeline, "pipeline stages (consecutive blocks, 1F1B)")
      ->check(weave::cli::positive());
  app.add_option("--replicate", f.replicate,
                 "fsdp: HSDP, the data ranks as this many replicas of shard groups (each shard "
                 "averaged over the replicas)")
      ->check(weave::cli::positive());
  app.add_option("--microbatch", f.microbatch,
                 "windows per micro-batch: each rank runs its share of the batch in micro-batches "
                 "of this many, accumulating their gradients (0: its share at once)")
      ->check(weave::cli::non_negative());
  app.add_flag("--reproducible", f.reproducible,
               "ddp/fsdp/zero: sum gradients, losses and the norm so that a run at any number of "
               "ranks ends with the same bits (needs --microbatch)");
  app.add_flag("--verify-layout", f.verify_layout,
               "check this layout's step against one process on a shrunken float64 copy "
               "(parallel::verify_layout), print what diverged, and exit");
  app.add_option("--microbatches", f.microbatches,
                 "micro-batches per step and data-parallel rank (0: twice --pipeline)")
      ->check(weave::cli::non_negative());
}

inline Flags parse(int argc, char** argv) {
  Flags f;
  CLI::App app("A character-level GPT trained on the fortunes text (examples/gpt).", "gpt");
  app.option_defaults()->always_capture_default();
  app.add_option("--strategy", f.strategy, "data, model or hybrid parallelism")
      ->check(CLI::IsMember({"ddp", "fsdp", "zero", "tp", "hybrid"}));
  app.add_option("--arch", f.arch, "gpt (GPT-2 blocks) or llama (RMSNorm, rotary, SwiGLU)")
      ->check(CLI::IsMember({"gpt", "llama"}));
  app.add_option("--kv-heads", f.kv_heads, "llama: key/value heads, dividing --heads (0: all)")
      ->check(weave::cli::non_negative());
  app.add_option("--ffn", f.ffn, "llama: the SwiGLU width (0: 8 dim / 3, rounded up to 64)")
      ->check(weave::cli::non_negative());
  app.add_flag("--pack", f.pack,
               "llama: each fortune a document of its own (end-of-text token, positions and "
               "attention restarting per document)");
  app.add_option("--data", f.data_dir, "directory of fortune files");
  app.add_option("--layers", f.layers)->check(weave::cli::positive());
  app.add_option("--dim", f.dim)->check(weave::cli::positive());
  app.add_option("--heads", f.heads)->check(weave::cli::positive());
  app.add_option("--context", f.context)->check(weave::cli::positive());
  app.add_option("--batch", f.batch, "global batch, in windows")->check(weave::cli::positive());
  app.add_option("--steps", f.steps)
      ->check(weave::cli::positive())
      ->check(CLI::Range(int64_t{1}, int64_t{1000000000}));  // beyond: a typo, not a plan
  app.add_option("--warmup", f.warmup, "linear warmup steps")->check(weave::cli::non_negative());
  app.add_option("--lr", f.lr, "peak learning rate")->check(weave::cli::positive());
  app.add_option("--min-lr", f.min_lr, "learning rate at the end of the cosine")
      ->check(weave::cli::non_negative());
  app.add_option("--seed", f.seed);
  app.add_option("--log-every", f.log_every, "steps between progress lines")
      ->check(weave::cli::positive());
  app.add_option("--log", f.log, "also write the metrics as JSON Lines (for weave-plot)");
  app.add_option("--tensorboard", f.tensorboard, "also write TensorBoard event files here");
  app.add_option("--peak-tflops", f.peak_tflops,
                 "one device's peak TFLOP/s (an H100's bf16: 989), for the MFU in the log")
      ->check(weave::cli::non_negative());
  app.add_option("--eval-every", f.eval_every, "steps between held-out evaluations")
      ->check(weave::cli::positive());
  app.add_option("--eval-windows", f.eval_windows)->check(weave::cli::positive());
  app.add_option("--checkpoint", f.checkpoint, "sharded checkpoint directory");
  app.add_option("--checkpoint-every", f.checkpoint_every)->check(weave::cli::positive());
  app.add_flag("--resume", f.resume, "resume from --checkpoint if it holds a save");
  app.add_option("--export", f.export_path,
                 "after training, write the whole model's parameters to this safetensors file");
  app.add_option("--stop-at", f.stop_at, "stop after this step (a resume test)");
  app.add_option("--kill-at", f.kill_at,
                 "the last rank kills itself (SIGKILL) after this step, on the first attempt under "
                 "weave-run (WEAVE_RESTART_COUNT 0): a restart test");
  app.add_flag("--checkpoint-activations", f.checkpoint_activations,
               "recompute each block in backward");
  app.add_option("--samples", f.samples, "lines sampled at the end")
      ->check(weave::cli::non_negative());
  app.add_option("--threads", f.threads, "compute threads per rank")->check(weave::cli::positive());
  std::string autocast;
  app.add_option("--autocast", autocast, "reduced-precision forward")
      ->check(CLI::IsMember({"bf16", "fp16"}));
  std::string param_dtype;
  app.add_option("--param-dtype", param_dtype,
                 "fsdp: gather the parameters in bf16 (float32 shards step, gradients reduced in "
                 "float32)")
      ->check(CLI::IsMember({"bf16"}));
  app.add_option("--device", f.device)->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--matmul-precision", f.matmul_precision,
                 "float32 matrix products on CUDA: highest (float32) or high (TF32)")
      ->check(CLI::IsMember({"highest", "high"}));
  app.add_flag("--cuda-graph", f.cuda_graph,
               "capture the training step as one CUDA graph after two eager steps (one GPU)");
  app.add_option("--backend", f.backend, "default: nccl for cuda, mpi for cpu")
      ->check(CLI::IsMember({"mpi", "nccl"}));
  app.add_option("--vocab", f.vocab, "widen the head past the characters' count")
      ->check(weave::cli::non_negative());
  add_layout_options(app, f);
  weave::cli::parse_or_exit(app, argc, argv);
  if (!autocast.empty()) f.autocast = autocast == "bf16" ? kBFloat16 : kFloat16;
  if (!param_dtype.empty()) f.param_dtype = kBFloat16;
  return f;
}

// Every rank must train the same model: a flag that differs on one rank (--lr, --batch, --seed)
// would train another one there, silently. The command lines meet as a hash (FNV-1a over the
// arguments, each ended by its 0 byte): one all_reduce of its maximum and its negation.
inline void check_same_command_line(int argc, char** argv) {
  uint64_t hash = 1469598103934665603ULL;
  std::string line;
  for (int i = 1; i < argc; ++i) {
    for (const char* c = argv[i];; ++c) {
      hash = (hash ^ uint8_t(*c)) * 1099511628211ULL;
      if (*c == 0) break;
    }
    line += std::string(i > 1 ? " " : "") + argv[i];
  }
  const int64_t mine = int64_t(hash >> 2);
  Tensor range = from_vector<int64_t>({mine, -mine}, {2});
  dist::all_reduce(range, dist::ReduceOp::Max);
  const std::vector<int64_t> r = range.to_vector<int64_t>();
  WEAVE_CHECK(r[0] == -r[1], "gpt",
              "the ranks were started with different flags (rank {}'s: '{}'); hint: launch every "
              "rank with the same command line",
              dist::rank(), line);
}

// The mesh of the flags: tensor-parallel ranks are every rank of a stage (and context group)
// under tp, --tp (2 unless given) under hybrid, --tp when given with ddp or fsdp; data
// parallelism takes the rest. Raises for axes that do not fit the world or the model.
inline parallel::ProcessMesh mesh_of(const Flags& f) {
  const int world = dist::world_size();
  const int context = f.context_parallel, pipeline = f.pipeline;
  const int tensor = f.strategy == "tp"       ? std::max(1, world / (context * pipeline))
                     : f.tp > 0               ? f.tp
                     : f.strategy == "hybrid" ? 2
                                              : 1;
  WEAVE_CHECK(world % (tensor * context * pipeline) == 0, "gpt",
              "--tp {} times --context-parallel {} times --pipeline {} does not divide the {} "
              "ranks; hint: run a multiple of their product",
              tensor, context, pipeline, world);
  const int data = world / (tensor * context * pipeline);
  const int microbatches = f.microbatches > 0 ? f.microbatches : 2 * pipeline;
  WEAVE_CHECK(pipeline == 1 || (f.experts == 0 && f.autocast != kFloat16 && f.layers >= pipeline &&
                                f.batch % (data * microbatches) == 0 &&
                                f.eval_windows % (data * microbatches) == 0),
              "gpt",
              "--pipeline {} takes a dense model without fp16 (found --experts {}{}), at least "
              "one block per stage (--layers {}), and --batch {} and --eval-windows {} in "
              "multiples of the {} data-parallel ranks times {} micro-batches",
              pipeline, f.experts, f.autocast == kFloat16 ? ", --autocast fp16" : "", f.layers,
              f.batch, f.eval_windows, data, microbatches);
  WEAVE_CHECK(
      f.experts == 0 || ((data * context) % f.expert_parallel == 0 && f.eval_windows % data == 0 &&
                         f.experts % f.expert_parallel == 0 && f.top_k <= f.experts),
      "gpt",
      "--expert-parallel {} must divide the {} data x context ranks and the {} experts, "
      "--top-k {} be at most the experts, and --eval-windows {} divide among the {} "
      "data-parallel ranks",
      f.expert_parallel, data * context, f.experts, f.top_k, f.eval_windows, data);
  // Micro-batches are dealt out whole: the batch divides into them, and each rank gets one or
  // more (unevenly under --reproducible ddp, whose sums do not mind; evenly otherwise: fsdp
  // gathers every unit for each micro-batch, so every rank runs as many).
  const int64_t microbatch = f.microbatch > 0 ? f.microbatch : f.batch / data;
  const bool uneven = f.reproducible && (f.strategy == "ddp" || f.strategy == "zero");
  WEAVE_CHECK(uneven ? (f.batch % microbatch == 0 && f.batch / microbatch >= data)
                     : f.batch % (data * microbatch) == 0,
              "gpt",
              "--batch {} does not divide among {} data-parallel ranks in micro-batches of {} "
              "windows{}",
              f.batch, data, microbatch, uneven ? " (every rank needs at least one)" : "");
  WEAVE_CHECK(f.replicate == 1 || (f.strategy == "fsdp" && data % f.replicate == 0), "gpt",
              "--replicate {} (HSDP: replicas of shard groups) needs --strategy fsdp and must "
              "divide the {} data-parallel ranks",
              f.replicate, data);
  return parallel::ProcessMesh({.data = data,
                                .tensor = tensor,
                                .pipeline = pipeline,
                                .context = context,
                                .expert = f.experts > 0 ? f.expert_parallel : 1,
                                .replicate = f.replicate});
}

// The flags' combinations that no layout trains.
inline void check_flags(const Flags& f) {
  WEAVE_CHECK(!f.pack || f.arch == "llama", "gpt",
              "--pack needs --arch llama: GPT-2's learned positions and attention take one "
              "document per window");
  WEAVE_CHECK(!f.param_dtype || f.strategy == "fsdp", "gpt",
              "--param-dtype is fsdp's mixed-precision policy; hint: --strategy fsdp, or "
              "--autocast bf16 for the others");
  WEAVE_CHECK(!f.cuda_graph || (f.device == "cuda" && dist::world_size() == 1 && f.experts == 0 &&
                                f.autocast != kFloat16 && f.strategy != "fsdp"),
              "gpt",
              "--cuda-graph captures one GPU's step: --device cuda at one rank, without --experts "
              "(their routing reads counts on the host), fsdp or --autocast fp16 (its scaler "
              "decides on the host)");
  WEAVE_CHECK(f.strategy != "zero" || (f.tp == 0 && f.context_parallel == 1 && f.pipeline == 1 &&
                                       f.experts == 0 && f.autocast != kFloat16 && !f.cuda_graph),
              "gpt",
              "--strategy zero (ZeRO-1) averages whole parameters over the data-parallel ranks in "
              "its step: without --tp, --context-parallel, --pipeline, --experts, --autocast "
              "fp16 or --cuda-graph");
  WEAVE_CHECK(
      !f.reproducible || ((f.strategy == "ddp" || f.strategy == "fsdp" || f.strategy == "zero") &&
                          f.tp == 0 && f.context_parallel == 1 && f.pipeline == 1 &&
                          f.experts == 0 && f.microbatch > 0 && f.eval_windows % f.microbatch == 0),
      "gpt",
      "--reproducible sums whole parameters over the data-parallel ranks: --strategy ddp, "
      "fsdp or zero without --tp, --context-parallel, --pipeline or --experts, with "
      "--microbatch N (windows per micro-batch, the same at every layout) dividing "
      "--eval-windows {}",
      f.eval_windows);
  WEAVE_CHECK(f.microbatch == 0 || (f.pipeline == 1 && !f.cuda_graph), "gpt",
              "--microbatch cuts each rank's share into micro-batches; --pipeline has its own "
              "(--microbatches) and --cuda-graph captures one step of one batch");
  WEAVE_CHECK(f.arch == "llama" || f.kv_heads == 0, "gpt",
              "--kv-heads {} needs --arch llama (GPT-2's attention has a key/value head per "
              "query head)",
              f.kv_heads);
}

// NCCL between GPUs unless --backend mpi says otherwise.
inline bool uses_nccl(const Flags& f) {
  return f.backend == "nccl" || (f.backend.empty() && f.device == "cuda");
}

// Linear warmup, then cosine to min_lr (the same formula in bench/training/gpt_torch.py).
inline double learning_rate(const Flags& f, int64_t step) {
  if (step < f.warmup) return f.lr * double(step + 1) / double(f.warmup);
  const double progress =
      std::min(1.0, double(step - f.warmup) / double(std::max<int64_t>(1, f.steps - f.warmup)));
  return f.min_lr + 0.5 * (f.lr - f.min_lr) * (1 + std::cos(M_PI * progress));
}

}  // namespace gpt
