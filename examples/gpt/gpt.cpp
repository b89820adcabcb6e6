// A character-level GPT trained on the quotations of Debian's `fortunes` package:
//   mpirun -np 2 gpt [--strategy ddp|fsdp|tp|hybrid] [--tp 2] [--layers 4] [--dim 256] [--heads 4]
//                    [--context 128] [--batch 16] [--steps 600] [--lr 1e-3] [--eval-every 100]
//                    [--checkpoint DIR [--checkpoint-every 100] [--resume] [--stop-at STEP]]
//                    [--no-sequence-parallel] [--samples 3] [--threads 1] [--seed 0]
//                    [--autocast bf16|fp16] [--checkpoint-activations]
//                    [--device cpu|cuda] [--backend mpi|nccl] [--vocab N] [--log FILE]
//                    [--context-parallel N [--cp-mode ring|all-to-all]]
//                    [--experts E [--expert-parallel N] [--top-k K]]
//                    [--pipeline N [--microbatches M]]
//                    [--arch gpt|llama [--kv-heads K] [--ffn N] [--pack]]
//                    [--cuda-graph] [--matmul-precision highest|high]
//                    [--peak-tflops T] [--tensorboard DIR]
// --device cuda puts each rank on a GPU (round-robin by local rank) with NCCL between them
// (--backend mpi: MPI, staging through the host; several ranks may share one GPU). --vocab
// widens the embedding and output layer past the characters' count (a larger model's head).
//
// The text (every fortune file, in name order, `%` separator lines dropped) is split once: the
// first 90% trains, the last 10% is held out. Each step takes `--batch` windows of context + 1
// characters from the training text at offsets every process derives from (seed, step), so a
// run at any number of ranks and any strategy sees the same global batch:
//   ddp     each rank takes its share of the windows; gradients averaged (DDP);
//   fsdp    as ddp, with parameters, gradients and AdamW state sharded (ZeRO-3; each block,
//           embedding, norm and head is a unit, gathered around its forward and backward);
//   tp      every rank takes all of them; heads, MLP units and vocabulary split over the ranks,
//           with sequence parallelism unless --no-sequence-parallel;
//   hybrid  tensor-parallel groups of --tp ranks, data parallel across them.
// ddp and fsdp also take --tp N (tensor-parallel groups of N ranks inside each replica), and two
// more axes; any product of the axes equal to the world size trains:
//   --context-parallel N   groups of N ranks split every sequence (zig-zag parts, balanced under
//                          the causal mask); attention runs across the group by ring attention
//                          (K/V blocks passed around) or all-to-all (heads split instead);
//                          data parallel across the groups;
//   --experts E            every block's MLP becomes E experts (each a 4 dim / K MLP, so a
//                          token costs the dense MLP's compute), top --top-k per token, with the
//                          load-balancing loss over the whole step's batch; --expert-parallel N
//                          spreads them over groups of N of the data x context ranks;
//   --pipeline N           N stages of consecutive blocks (the embeddings on the first, the
//                          head on the last), each split over the tensor axis and under DDP (or
//                          fsdp) over data x context; 1F1B over --microbatches (2 N), the last
//                          one's backward averaging (reduce-scattering) all of them.
// The wrappers read where each parameter lives (its placement): experts average over the ranks
// holding them, with the expert scale; the gradient norm counts every piece once.
// --arch llama trains a Llama-class model instead (models::Llama: RMSNorm, rotary positions,
// grouped-query attention with --kv-heads key/value heads, SwiGLU), on every axis above
// (models::Llama split by models::ModelSplit: the library's split of it); --pack
// makes each fortune a document of its own, ended by an end-of-text token, and hands the model
// each token's position in its document and the document's id, so attention and positions
// restart at every document.
// --autocast runs forward, the loss and the held-out evaluation under AutocastGuard (matrix
// products and attention in bfloat16/float16, float32 parameters); fp16 adds a GradScaler
// whose overflow verdict the data-parallel ranks agree on.
// --checkpoint-activations keeps only each block's input for backward and recomputes the block
// there (autograd::checkpoint): the same gradients, less activation memory, one more forward.
// --cuda-graph (one GPU) captures the whole step as a CUDA graph after two eager steps and
// replays it (CapturedStep): the same numbers, without the host's per-op cost.
// Every strategy starts from the same weights (the whole model is initialized on every rank
// with the seed, then split), so all of them follow one process step for step.
//
// Rank 0 prints (on stderr, data::MetricsLogger) step, loss, lr, tokens/s (and with
// --peak-tflops, each device's peak, the model FLOPs utilization), the gradient norm, peak
// memory and the ETA every --log-every (20) steps and the held-out loss every --eval-every
// steps (--tensorboard DIR writes them for TensorBoard too), and at the end `heldout_loss=X.XXXX`
// (stdout) followed by a few sampled lines. --log FILE also writes them as JSON Lines, which
// `weave-plot FILE -o curves.png` draws.
#include <weave/weave.h>

#include "data.h"
#include "flags.h"
#include "graphed.h"
#include "models.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

using namespace weave;
using gpt::Batch;
using gpt::Corpus;
using gpt::Flags;
using gpt::Gpt;
using gpt::LanguageModel;
using gpt::MoeGpt;
using gpt::ParallelGpt;

namespace {

// GPT-2's initialization: weights N(0, 0.02), biases 0, norms 1 (their own ones). Built under
// nn::DeferredInit, these set recipes: each parameter is drawn by its name from the seed.
void initialize(nn::Module& model) {
  for (auto& [name, p] : model.named_parameters()) {
    if (name.ends_with(".bias"))
      nn::init::zeros_(p);
    else if (name.find("norm") == std::string::npos)
      nn::init::normal_(p, 0, 0.02);
  }
}

// The model of this rank (its pipeline stage's and tensor-parallel slice's part), drawn by
// parameter name from the seed (nn::DeferredInit), so that every layout holds what one process
// holds, and no rank builds more than its part. Left deferred for fsdp, which draws only this
// rank's shards of it.
std::shared_ptr<LanguageModel> build(const Flags& f, int64_t vocab,
                                     const parallel::ProcessMesh& mesh, bool sequence_parallel,
                                     std::optional<dist::Group> experts = std::nullopt,
                                     bool leave_deferred = false) {
  const int stages = mesh.shape().pipeline;
  const bool split = experts || mesh.shape().context > 1 || mesh.shape().tensor > 1 || stages > 1;
  const std::optional<dist::Group> context =
      mesh.shape().context > 1 ? std::optional(mesh.context()) : std::nullopt;
  std::shared_ptr<LanguageModel> model;
  {
    nn::DeferredInit deferred(f.seed);
    if (f.arch == "llama" && (split || f.experts > 0))  // the library's split, in one call
      model = std::make_shared<gpt::ParallelLlama>(
          f, vocab,
          models::ModelSplit::from_mesh(
              mesh, {.context_mode = gpt::context_mode(f), .moe = gpt::llama_experts(f)}));
    else if (split)
      model = std::make_shared<ParallelGpt>(
          f, vocab, mesh.tensor(), sequence_parallel, context, experts, mesh.data_and_context(),
          gpt::stage_range(f.layers, mesh.pipeline_rank(), stages));
    else if (f.arch == "llama")
      model = std::make_shared<gpt::Llama>(f, vocab);
    else if (f.experts > 0)
      model = std::make_shared<MoeGpt>(f, vocab, mesh.data_and_context());
    else
      model = std::make_shared<Gpt>(f, vocab);
    initialize(*model);
  }
  model->checkpoint_activations = f.checkpoint_activations;
  model->to(f.placed);
  if (!leave_deferred) nn::materialize(*model);
  return model;
}

// Mean loss over the held-out windows: each data-parallel rank evaluates its share (through the
// pipeline's stages when there is one, the loss on the last; through fsdp's units when sharded).
double heldout_loss(LanguageModel& model, const Flags& f, const Corpus& corpus,
                    const parallel::ProcessMesh& mesh, parallel::Pipeline* pipe = nullptr,
                    parallel::DataParallelWrapper* sharded = nullptr) {
  NoGradGuard no_grad;
  model.eval();
  const int64_t span = int64_t(corpus.heldout.size()) - f.context - 1;
  std::vector<int64_t> mine;
  for (int64_t i = mesh.data_rank(); i < f.eval_windows; i += mesh.shape().data)
    mine.push_back(i * span / f.eval_windows);
  double total = 0;
  const size_t per_batch = size_t(pipe ? f.batch / mesh.shape().data : f.batch);
  // Sharded, every rank runs as many forwards as data rank 0 (the most windows) so that the
  // units' gathers pair up; a rank out of windows runs its first again and counts nothing.
  const size_t most = size_t((f.eval_windows + mesh.shape().data - 1) / mesh.shape().data);
  const size_t rounds = ((sharded ? most : mine.size()) + per_batch - 1) / per_batch;
  for (size_t round = 0; round < rounds; ++round) {
    const size_t first = round * per_batch;
    const bool spare = first >= mine.size();
    const size_t last = spare ? first + 1 : std::min(mine.size(), first + per_batch);
    const std::vector<int64_t> windows =
        spare ? std::vector<int64_t>{0}
              : std::vector<int64_t>(mine.begin() + long(first), mine.begin() + long(last));
    const Batch batch =
        gpt::make_batch(corpus.heldout, windows, f.context, corpus.end_of_text, f.placed);
    // GPT's stages run sequence first ([T, B, ...]), Llama's batch first.
    Tensor logits = pipe      ? pipe->predict(batch.model_inputs(), f.arch == "gpt" ? 1 : 0)
                    : sharded ? sharded->forward(batch.model_inputs())
                              : model(batch.model_inputs());
    if (logits.defined() && !spare)  // the last stage's
      total += model.loss(logits, batch.targets).item<double>() * double(last - first);
  }
  // Under context parallelism each rank's loss covers its part of the positions.
  Tensor sum = full({1}, total, {.dtype = kFloat64});
  using parallel::Axis;
  dist::all_reduce(sum, dist::ReduceOp::Sum,
                   mesh.group({Axis::Data, Axis::Context, Axis::Pipeline}));
  model.train();
  return sum.item<double>() / double(f.eval_windows * mesh.shape().context);
}

// Lines sampled from a newline, temperature 0.8, on the ranks of data-parallel group 0 (the
// tensor-parallel ranks decode together), or on every rank of a sharded model (fsdp's units
// gather as its blocks decode); printed by rank 0.
void sample(LanguageModel& model, const Flags& f, const Corpus& corpus,
            const parallel::ProcessMesh& mesh, bool sharded = false) {
  if ((mesh.data_rank() != 0 && !sharded) || f.samples <= 0) return;
  NoGradGuard no_grad;
  model.eval();
  Generator g(f.seed + 7);  // the same draws on every tensor-parallel rank
  const auto newline = std::find(corpus.chars.begin(), corpus.chars.end(), '\n');
  const int64_t start = newline - corpus.chars.begin();
  std::vector<nn::KVCache> caches;
  for (int64_t i = 0; i < f.layers; ++i) caches.emplace_back(f.context);
  Tensor ids = full({f.samples, 1}, double(start), {.dtype = kInt64, .device = f.placed});
  std::vector<std::string> text(size_t(f.samples));
  for (int64_t t = 0; t + 1 < f.context; ++t) {
    Tensor logits = model.decode(ids, caches).narrow(1, 0, int64_t(corpus.chars.size()));
    ids = multinomial(softmax(logits / 0.8, -1), 1, false, &g);
    const auto drawn = ids.to_vector<int64_t>();
    for (size_t s = 0; s < drawn.size(); ++s) text[s] += char(corpus.chars[size_t(drawn[s])]);
  }
  if (dist::rank() == 0) {
    std::printf("samples:\n");
    for (const auto& s : text) {
      std::string line = s.substr(0, s.find('\n'));
      std::printf("  | %s\n", line.c_str());
    }
  }
  model.train();
}

}  // namespace

// Every rank must train the same model: a flag that differs on one rank (--lr, --batch, --seed)
// would train another one there, silently. The command lines meet as a hash (FNV-1a over the
// arguments, each ended by its 0 byte): one all_reduce of its maximum and its negation.
void check_same_command_line(int argc, char** argv) {
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

bool uses_nccl(const Flags& f) {
  return f.backend == "nccl" || (f.backend.empty() && f.device == "cuda");
}

// Everything after init: builds, trains, evaluates and samples on every rank.
int train_and_sample(Flags& f, int argc, char** argv) {
  const bool nccl = uses_nccl(f);
  check_same_command_line(argc, argv);
  // Under NCCL the runtime assigned this rank's GPU; under MPI ranks take GPUs round-robin too.
  const Device device = f.device == "cpu" ? kCPU
                        : nccl
                            ? dist::device()
                            : Device::cuda(dist::local_rank() % std::max(1, cuda::device_count()));
  f.placed = device;
  set_num_threads(f.threads);
  set_float32_matmul_precision(f.matmul_precision);
  const int world = dist::world_size();
  const bool fully_sharded = f.strategy == "fsdp";
  // Tensor-parallel ranks: every rank of a stage (and context group) under tp; --tp (2 unless
  // given) under hybrid; --tp when given with ddp or fsdp.
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
              "one block per stage (--layers {}), and --batch {} and "
              "--eval-windows {} in multiples of the {} data-parallel ranks times {} "
              "micro-batches",
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
  WEAVE_CHECK(!f.pack || f.arch == "llama", "gpt",
              "--pack needs --arch llama: GPT-2's learned positions and attention take one "
              "document per window");
  WEAVE_CHECK(!f.param_dtype || fully_sharded, "gpt",
              "--param-dtype is fsdp's mixed-precision policy; hint: --strategy fsdp, or "
              "--autocast bf16 for the others");
  WEAVE_CHECK(!f.cuda_graph || (f.device == "cuda" && world == 1 && f.experts == 0 &&
                                f.autocast != kFloat16 && !fully_sharded),
              "gpt",
              "--cuda-graph captures one GPU's step: --device cuda at one rank, without --experts "
              "(their routing reads counts on the host), fsdp or --autocast fp16 (its scaler "
              "decides on the host)");
  WEAVE_CHECK(f.arch == "llama" || f.kv_heads == 0, "gpt",
              "--kv-heads {} needs --arch llama (GPT-2's attention has a key/value head per "
              "query head)",
              f.kv_heads);
  const parallel::ProcessMesh mesh({.data = data,
                                    .tensor = tensor,
                                    .pipeline = pipeline,
                                    .context = context,
                                    .expert = f.experts > 0 ? f.expert_parallel : 1});
  // The ranks that hold every expert between them (mesh.expert()), when experts are spread.
  const std::optional<dist::Group> experts =
      mesh.shape().expert > 1 ? std::optional(mesh.expert()) : std::nullopt;
  WEAVE_CHECK(f.batch % data == 0, "gpt", "--batch {} does not divide among {} data-parallel ranks",
              f.batch, data);
  // Sequence parallelism splits what experts and context parallelism need whole.
  // (Llama's layers run batch first, whole sequences on every tensor-parallel rank.)
  const bool sequence_parallel =
      tensor > 1 && f.sequence_parallel && f.experts == 0 && context == 1 && f.arch == "gpt";
  Corpus corpus = gpt::load_corpus(f.data_dir, f.pack);
  corpus.vocab = std::max(corpus.vocab, (f.vocab + 7) / 8 * 8);
  WEAVE_CHECK(int64_t(corpus.heldout.size()) > f.context + 1, "gpt",
              "--context {} needs more text: the held-out tenth of {} holds {} characters "
              "(train {}); hint: a shorter --context or more text",
              f.context, f.data_dir, corpus.heldout.size(), corpus.train.size());

  auto model = build(f, corpus.vocab, mesh, sequence_parallel, experts, fully_sharded);
  std::vector<std::pair<std::string, Shape>> model_shapes;  // before fsdp shards the parameters
  for (const auto& [name, p] : model->named_parameters())
    model_shapes.emplace_back(name, p.shape());
  // One data-parallel wrapper or none: DDP averages each parameter where its placement says, FSDP
  // shards it there (kept gathered across a pipeline's micro-batches, torchtitan's choice).
  std::unique_ptr<parallel::DataParallelWrapper> data_parallel;
  if (fully_sharded) {
    data_parallel = std::make_unique<parallel::FullyShardedDataParallel>(
        *model, parallel::FSDPOptions{.reshard_after_forward = pipeline == 1,
                                      .group = mesh.data_and_context(),
                                      .param_dtype = f.param_dtype,
                                      .reduce_dtype = kFloat32,
                                      .output_dtype = kFloat32});
  } else if (data * context > 1) {
    data_parallel = std::make_unique<parallel::DistributedDataParallel>(
        *model, parallel::DDPOptions{.group = mesh.data_and_context()});
  }
  // FSDP's ranks run every forward together (its units gather): evaluation goes through it.
  parallel::DataParallelWrapper* const sharded = fully_sharded ? data_parallel.get() : nullptr;
  // The stages pass activations and gradients; each stage's wrapper syncs on the last micro-batch.
  std::unique_ptr<parallel::Pipeline> pipe;
  if (pipeline > 1) {
    const parallel::PipelineOptions options{.microbatches = microbatches, .group = mesh.pipeline()};
    pipe = data_parallel ? std::make_unique<parallel::Pipeline>(*data_parallel, options)
                         : std::make_unique<parallel::Pipeline>(*model, options);
  }
  // The GPT recipe's groups: no weight decay on biases, norms and embeddings. Under fsdp the
  // optimizer steps this rank's shards only, each part with its parameter's group.
  const std::vector<optim::ParamGroup> groups = optim::weight_decay_groups(*model, f.weight_decay);
  optim::AdamW optimizer(data_parallel ? data_parallel->param_groups(groups) : groups,
                         {.lr = f.lr, .capturable = f.cuda_graph});
  std::optional<gpt::GraphedTraining> graphed;
  if (f.cuda_graph) graphed.emplace(*model, optimizer, f);
  // Linear warmup, then cosine to min_lr (the same formula in bench/training/gpt_torch.py).
  optim::LRScheduler scheduler(optimizer, [f](int64_t step) {
    if (step < f.warmup) return f.lr * double(step + 1) / double(f.warmup);
    const double progress =
        std::min(1.0, double(step - f.warmup) / double(std::max<int64_t>(1, f.steps - f.warmup)));
    return f.min_lr + 0.5 * (f.lr - f.min_lr) * (1 + std::cos(M_PI * progress));
  });
  // float16's range needs loss scaling; bfloat16 has float32's range and needs none. Every
  // rank agrees on skipping (the world: tensor-parallel shards overflow separately).
  parallel::GradScaler scaler({.enabled = f.autocast == kFloat16});

  data::TrainingState state{.model = data_parallel ? &data_parallel->sharded_module() : model.get(),
                            .optimizer = &optimizer,
                            .scheduler = &scheduler};
  int64_t step = 0;
  namespace fs = std::filesystem;
  if (f.resume && !f.checkpoint.empty() && fs::exists(fs::path(f.checkpoint) / "index.json")) {
    parallel::load_sharded_checkpoint(f.checkpoint, state);
    step = std::stoll(state.user.at("step"));
    if (scaler.enabled())  // the loss scale and its growth count resume too
      scaler.load_state_dict(
          {{"scale", std::stod(state.user.at("scaler.scale"))},
           {"growth_tracker", std::stod(state.user.at("scaler.growth_tracker"))}});
    if (dist::rank() == 0) std::printf("resumed at step %lld\n", static_cast<long long>(step));
  }
  if (dist::rank() == 0) {
    int64_t count = 0;
    for (const auto& [name, shape] : model_shapes) count += shape.numel();
    std::printf(
        "%s: %s, %s; %lld layers, dim %lld, %lld heads, context %lld, batch %lld, vocab %lld "
        "(%zu used), %lld parameters on rank 0; %zu train / %zu held-out characters%s\n",
        f.arch.c_str(), f.strategy.c_str(), mesh.str().c_str(), static_cast<long long>(f.layers),
        static_cast<long long>(f.dim), static_cast<long long>(f.heads),
        static_cast<long long>(f.context), static_cast<long long>(f.batch),
        static_cast<long long>(corpus.vocab), corpus.chars.size(), static_cast<long long>(count),
        corpus.train.size(), corpus.heldout.size(), f.pack ? ", packed" : "");
  }

  const int64_t local_batch = f.batch / data;
  const int64_t train_span = int64_t(corpus.train.size());
  // Progress on stderr (rank 0), and with --log the metrics file for tools/weave-plot.
  // MFU counts the whole model: every rank's pieces, once per data x context replica.
  Tensor pieces = full({1}, 0.0, {.dtype = kFloat64});
  for (const auto& [name, shape] : model_shapes) pieces.add_(double(shape.numel()));
  dist::all_reduce(pieces, dist::ReduceOp::Sum);
  const auto parameters = int64_t(pieces.item<double>() / double(data * context));
  data::MetricsLogger metrics(
      {.path = f.log,
       .enabled = dist::rank() == 0,
       .total_steps = f.steps,
       .start_step = step,
       .device = device,
       .flops_per_token = data::transformer_flops_per_token(parameters, f.layers, f.dim, f.context),
       .peak_flops = f.peak_tflops * 1e12 * world,
       .tensorboard_dir = f.tensorboard});
  double loss_sum = 0;
  int64_t losses = 0, tokens = 0;
  while (step < f.steps) {
    std::vector<int64_t> offsets = gpt::train_offsets(f, train_span, step);
    offsets = {offsets.begin() + mesh.data_rank() * local_batch,
               offsets.begin() + (mesh.data_rank() + 1) * local_batch};
    const Batch batch =
        gpt::make_batch(corpus.train, offsets, f.context, corpus.end_of_text, device);
    const Tensor& targets = batch.targets;
    Tensor loss;
    double grad_norm = 0;
    if (graphed) {
      graphed->step(batch);
    } else {
      optimizer.zero_grad();
      if (pipe) {  // forward and backward of every micro-batch; the loss on the last stage
        std::optional<AutocastGuard> autocast;
        if (f.autocast) autocast.emplace(*f.autocast);
        loss = pipe->train_step(batch.model_inputs(), targets,
                                [&](const Tensor& logits, const Tensor& target) {
                                  return model->loss(logits, target);
                                });
      } else {
        {
          std::optional<AutocastGuard> autocast;
          if (f.autocast) autocast.emplace(*f.autocast);
          const nn::Inputs in = batch.model_inputs();
          Tensor logits = data_parallel ? data_parallel->forward(in) : (*model)(in);
          loss = model->loss(logits, targets);
        }
        scaler.scale(loss).backward();
      }
      scaler.unscale_(optimizer.params());  // clipping sees the true gradients
      // The whole model's norm: each parameter's placement says how many ranks hold its piece.
      grad_norm = parallel::clip_grad_norm_(optimizer.params(), f.clip);
      scaler.step(optimizer);
      scaler.update();
    }
    scheduler.step();
    ++step;
    loss_sum += loss.defined() ? loss.item<double>() : 0;  // the last stage's
    ++losses;
    tokens += f.batch * f.context;
    if (step % f.log_every == 0 || step == f.steps) {
      if (graphed) loss_sum = graphed->take_loss_sum(), grad_norm = graphed->norm();
      Tensor mean = full({1}, loss_sum / double(losses * data * context), {.dtype = kFloat64});
      dist::all_reduce(
          mean, dist::ReduceOp::Sum,
          mesh.group({parallel::Axis::Data, parallel::Axis::Context, parallel::Axis::Pipeline}));
      metrics.log_step({.step = step,
                        .loss = mean.item<double>(),
                        .lr = scheduler.lr(),
                        .tokens = tokens,
                        .grad_norm = grad_norm});
      loss_sum = 0, losses = 0, tokens = 0;
    }
    if (step % f.eval_every == 0 && step < f.steps) {
      std::optional<AutocastGuard> autocast;
      if (f.autocast) autocast.emplace(*f.autocast);
      metrics.log_eval(step, "heldout_loss",
                       heldout_loss(*model, f, corpus, mesh, pipe.get(), sharded));
    }
    if (!f.checkpoint.empty() &&
        (step % f.checkpoint_every == 0 || step == f.steps || step == f.stop_at)) {
      state.user = {{"step", std::to_string(step)}};
      for (const auto& [key, value] : scaler.state_dict()) {
        char text[32];  // %.17g: the double comes back bit for bit
        std::snprintf(text, sizeof text, "%.17g", value);
        state.user["scaler." + key] = text;
      }
      parallel::save_sharded_checkpoint(f.checkpoint, state);
    }
    if (dist::rank() == 0) std::fflush(stdout);
    if (step == f.stop_at) {
      if (dist::rank() == 0) std::printf("stopped at step %lld\n", static_cast<long long>(step));
      return 0;
    }
  }
  std::optional<AutocastGuard> autocast;
  if (f.autocast) autocast.emplace(*f.autocast);
  const double held = heldout_loss(*model, f, corpus, mesh, pipe.get(), sharded);
  metrics.log_eval(f.steps, "heldout_loss", held);
  if (dist::rank() == 0) std::printf("heldout_loss=%.4f\n", held);
  // Decoding appends one position at a time, which sequence parallelism cannot split: the same
  // parameters in a model built without it.
  if (experts || pipe) {
    if (dist::rank() == 0)
      std::printf("samples: none (the %s)\n",
                  pipe ? "blocks are cut into pipeline stages" : "experts are spread over ranks");
  } else if (sequence_parallel || context > 1) {
    std::shared_ptr<LanguageModel> decoder =
        f.arch == "llama"
            ? std::shared_ptr<LanguageModel>(std::make_shared<gpt::ParallelLlama>(
                  f, corpus.vocab,
                  models::ModelSplit{.tensor = mesh.tensor(), .moe = gpt::llama_experts(f)}))
            : std::make_shared<ParallelGpt>(f, corpus.vocab, mesh.tensor(), false);
    decoder->to(device);
    decoder->load_state_dict(data_parallel ? data_parallel->full_state_dict()
                                           : model->state_dict());
    sample(*decoder, f, corpus, mesh);
  } else if (sharded) {  // every rank decodes, each unit gathered as it runs
    sharded->run([&] { sample(*model, f, corpus, mesh, /*sharded=*/true); });
  } else {
    sample(*model, f, corpus, mesh);
  }
  // Over the whole run: construction, training, evaluation and sampling.
  if (dist::rank() == 0)
    std::printf("peak tensor memory on rank 0: %.1f MB (memory_stats)\n",
                double(memory_stats(device).peak) / 1e6);
  return 0;
}

int main(int argc, char** argv) {
  Flags f;
  try {
    f = gpt::parse(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  dist::InitGuard distributed(uses_nccl(f) ? dist::Backend::NCCL : dist::Backend::MPI);
  try {
    return train_and_sample(f, argc, argv);
  } catch (const std::exception& e) {
    dist::exit_with_error(e);  // the error once for the whole job, with the ranks that raised it
  }
}
