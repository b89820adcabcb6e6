// A character-level GPT trained on the quotations of Debian's `fortunes` package:
//   mpirun -np 2 gpt [--strategy ddp|fsdp|zero|tp|hybrid] [--tp 2] [--layers 4] [--dim 256]
//   [--heads 4]
//                    [--context 128] [--batch 16] [--steps 600] [--lr 1e-3] [--eval-every 100]
//                    [--checkpoint DIR [--checkpoint-every 100] [--resume] [--stop-at STEP]
//                     [--kill-at STEP]]
//                    [--no-sequence-parallel] [--samples 3] [--threads 1] [--seed 0]
//                    [--autocast bf16|fp16] [--checkpoint-activations]
//                    [--device cpu|cuda] [--backend mpi|nccl] [--vocab N] [--log FILE]
//                    [--context-parallel N [--cp-mode ring|all-to-all]]
//                    [--experts E [--expert-parallel N] [--top-k K] [--expert-bias R]]
//                    [--pipeline N [--microbatches M]]
//                    [--arch gpt|llama [--kv-heads K] [--ffn N] [--pack]]
//                    [--cuda-graph] [--matmul-precision highest|high]
//                    [--microbatch N] [--reproducible] [--export FILE] [--verify-layout]
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
//   zero    as ddp, the gradients averaged in the optimizer's step, each rank's AdamW state a
//           slice of the flattened parameters (ZeRO-1);
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
//                          load-balancing loss over the whole step's batch (--expert-bias R:
//                          a selection bias moved by R a step by the step's loads instead);
//                          --expert-parallel N spreads them over groups of N of the data x
//                          context ranks; each logged step records the routing (metrics file);
//   --no-shard-vocabulary  ddp and fsdp split the embedding and head by vocabulary rows over
//                          the data (shard) ranks by default: each rank holds 1/N of them, its
//                          tokens' and hidden states travel instead, and fsdp never gathers
//                          them; this flag keeps them whole (fsdp gathers them as units);
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
// --microbatch N runs each rank's share of the batch as micro-batches of N windows (gradient
// accumulation under no_sync()), dealt by global index. --reproducible (ddp, fsdp, HSDP, zero) sums
// the gradients, the losses and the gradient norm so that their bits do not depend on the
// number of ranks: the same flags at 1, 2, 3 or 4 ranks (or a run resumed at fewer) print the
// same losses and save the same weights (docs/reproducibility.md). --export FILE writes the
// trained parameters, whole, to one safetensors file.
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
// --peak-tflops, each device's peak, the model FLOPs utilization), the gradient norm, the worst
// rank's tensor and resident peaks and the ETA every --log-every (20) steps and the held-out loss
// every --eval-every steps (--tensorboard DIR writes them for TensorBoard too), and at the end
// `heldout_loss=X.XXXX` (stdout) followed by a few sampled lines. --log FILE also writes them as
// JSON Lines, which `weave-plot FILE -o curves.png` draws.
#include <weave/weave.h>

#include "data.h"
#include "flags.h"
#include "graphed.h"
#include "model.h"
#include "stepper.h"
#include "verify.h"

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

using namespace weave;
using gpt::Batch;
using gpt::Corpus;
using gpt::Flags;

namespace {

// Runs `body` under --autocast (when given).
template <typename Body>
auto autocast(const Flags& f, Body&& body) {
  std::optional<AutocastGuard> guard;
  if (f.autocast) guard.emplace(*f.autocast);
  return body();
}

// One run: the model of this rank, its data-parallel wrapper (DDP or FSDP, over the data x
// context ranks) and pipeline, the optimizer and its schedule; then training, evaluation and
// sampling.
class Run {
 public:
  Run(Flags& f, Device device)
      : f_(f), device_(device), mesh_(gpt::mesh_of(f)), split_(gpt::split_of(f, mesh_)) {
    corpus_ = gpt::load_corpus(f.data_dir, f.pack);
    corpus_.vocab = std::max(corpus_.vocab, (f.vocab + 7) / 8 * 8);
    WEAVE_CHECK(int64_t(corpus_.heldout.size()) > f.context + 1, "gpt",
                "--context {} needs more text: the held-out tenth of {} holds {} characters "
                "(train {}); hint: a shorter --context or more text",
                f.context, f.data_dir, corpus_.heldout.size(), corpus_.train.size());
    build();
    optimize();
  }
  int train();

 private:
  void build();
  void optimize();
  void resume();
  void announce() const;
  data::MetricsLogger make_metrics() const;
  std::optional<double> step_loss(const std::vector<Batch>& batches, double& grad_norm);
  double microbatch_losses(const std::vector<Batch>& batches);
  void log_step(data::MetricsLogger& metrics, double& grad_norm);
  void save() const;
  double heldout_loss();
  double reproducible_heldout_loss();
  void sample_lines();
  void sample(nn::CausalLM& model) const;

  Tensor objective(const Tensor& logits, const Tensor& targets) const {
    return gpt::objective(split_, logits, targets);
  }
  Tensor forward(const nn::Inputs& inputs) { return wrapper_->forward(inputs); }
  nn::Module& trained() { return wrapper_->sharded_module(); }

  Flags& f_;
  Device device_;
  parallel::ProcessMesh mesh_;
  models::ModelSplit split_;
  Corpus corpus_;
  std::shared_ptr<nn::CausalLM> model_;
  int64_t parameters_ = 0;  // the whole model's (every rank's pieces, once)
  std::unique_ptr<parallel::DataParallelWrapper> wrapper_;
  std::unique_ptr<parallel::Pipeline> pipe_;
  std::unique_ptr<gpt::Stepper> stepper_;
  std::unique_ptr<optim::LRScheduler> scheduler_;
  std::unique_ptr<parallel::GradScaler> scaler_;
  std::optional<gpt::GraphedTraining> graphed_;
  data::TrainingState state_;
  int64_t step_ = 0;
  double loss_sum_ = 0;
  int64_t losses_ = 0, tokens_ = 0;
};

// This rank's part of the model (its pipeline stage's and tensor-parallel slices), drawn by
// parameter name from the seed (nn::DeferredInit), so that every layout holds what one process
// holds and no rank builds more than its part; left deferred for fsdp, which draws only this
// rank's shards of it. Then its wrapper: DDP averages each parameter where its placement says,
// FSDP shards it there (kept gathered across a pipeline's micro-batches, torchtitan's choice).
void Run::build() {
  const bool fully_sharded = f_.strategy == "fsdp";
  {
    nn::DeferredInit deferred(f_.seed);
    model_ = gpt::make_model(f_, corpus_.vocab, split_);
    gpt::initialize(*model_);
  }
  model_->to(device_);
  Tensor pieces = full({1}, 0.0, {.dtype = kFloat64});
  for (const auto& [name, p] : model_->named_parameters()) pieces.add_(double(p.numel()));
  dist::all_reduce(pieces, dist::ReduceOp::Sum);
  parameters_ = int64_t(pieces.item<double>() / double(mesh_.shape().data * mesh_.shape().context));
  if (!fully_sharded) parallel::materialize(*model_);  // its seed agreed over the cut groups
  wrapper_ = parallel::data_parallel(*model_, mesh_, gpt::wrapping(f_, mesh_));
  // The stages pass activations and gradients; each stage's wrapper syncs on the last
  // micro-batch.
  if (mesh_.shape().pipeline > 1)
    pipe_ = std::make_unique<parallel::Pipeline>(
        *wrapper_,
        parallel::PipelineOptions{
            .microbatches = f_.microbatches > 0 ? f_.microbatches : 2 * mesh_.shape().pipeline,
            .group = mesh_.pipeline()});
}

// The optimizer step (stepper.h: AdamW, or ZeRO-1's), its schedule, the fp16 loss scaler, and
// what checkpoints save.
void Run::optimize() {
  stepper_ = std::make_unique<gpt::Stepper>(f_, *model_, *wrapper_, mesh_);
  scheduler_ = std::make_unique<optim::LRScheduler>(
      stepper_->optimizer(), [f = f_](int64_t step) { return gpt::learning_rate(f, step); });
  // float16's range needs loss scaling; bfloat16 has float32's range and needs none. Every
  // rank agrees on skipping (the world: tensor-parallel shards overflow separately).
  scaler_ = std::make_unique<parallel::GradScaler>(
      parallel::GradScalerOptions{.enabled = f_.autocast == kFloat16});
  if (f_.cuda_graph)
    graphed_.emplace([this](const nn::Inputs& in,
                            const Tensor& targets) { return objective((*model_)(in), targets); },
                     stepper_->optimizer(), f_);
  state_ = {
      .model = &trained(), .optimizer = &stepper_->optimizer(), .scheduler = scheduler_.get()};
}

// Back to the step of --checkpoint's last save (model, optimizer, schedule, loss scale).
void Run::resume() {
  namespace fs = std::filesystem;
  if (!f_.resume || f_.checkpoint.empty() || !fs::exists(fs::path(f_.checkpoint) / "index.json"))
    return;
  parallel::load_sharded_checkpoint(f_.checkpoint, state_);
  step_ = std::stoll(state_.user.at("step"));
  if (scaler_->enabled())  // the loss scale and its growth count resume too
    scaler_->load_state_dict(
        {{"scale", std::stod(state_.user.at("scaler.scale"))},
         {"growth_tracker", std::stod(state_.user.at("scaler.growth_tracker"))}});
  if (dist::rank() == 0) std::printf("resumed at step %lld\n", static_cast<long long>(step_));
}

void Run::announce() const {
  if (dist::rank() != 0) return;
  std::printf(
      "%s: %s, %s; %lld layers, dim %lld, %lld heads, context %lld, batch %lld, vocab %lld "
      "(%zu used), %lld parameters; %zu train / %zu held-out characters%s\n",
      f_.arch.c_str(), f_.strategy.c_str(), mesh_.str().c_str(), static_cast<long long>(f_.layers),
      static_cast<long long>(f_.dim), static_cast<long long>(f_.heads),
      static_cast<long long>(f_.context), static_cast<long long>(f_.batch),
      static_cast<long long>(corpus_.vocab), corpus_.chars.size(),
      static_cast<long long>(parameters_), corpus_.train.size(), corpus_.heldout.size(),
      f_.pack ? ", packed" : "");
}

// Progress on stderr (rank 0), and with --log the metrics file for tools/weave-plot. MFU counts
// the whole model.
data::MetricsLogger Run::make_metrics() const {
  return data::MetricsLogger({.path = f_.log,
                              .enabled = dist::rank() == 0,
                              .total_steps = f_.steps,
                              .start_step = step_,
                              .device = device_,
                              .flops_per_token = data::transformer_flops_per_token(
                                  parameters_, f_.layers, f_.dim, f_.context),
                              .peak_flops = f_.peak_tflops * 1e12 * dist::world_size(),
                              .tensorboard_dir = f_.tensorboard});
}

// Forward and backward of each micro-batch, all but the last under no_sync(); the mean loss of
// the step's whole batch. Under --reproducible each micro-batch's loss is its own mean (the
// wrapper averages over every rank's micro-batches) and the losses add exactly over the ranks.
double Run::microbatch_losses(const std::vector<Batch>& batches) {
  const size_t count = batches.size();
  double sum = 0;
  for (size_t i = 0; i < count; ++i) {
    auto run = [&] {
      const nn::Inputs in = split_.local_inputs(batches[i].model_inputs());
      const Tensor targets = split_.local_sequence(batches[i].targets);
      const Tensor loss = autocast(f_, [&] { return objective(forward(in), targets); });
      sum += loss.item<double>();
      scaler_->scale(f_.reproducible || count == 1 ? loss : loss / double(count)).backward();
    };
    if (i + 1 == count) {
      run();
    } else {
      const parallel::NoSyncGuard accumulate = wrapper_->no_sync();
      run();
    }
  }
  if (!f_.reproducible) return sum / double(count);
  const int64_t all = f_.batch / f_.microbatch;
  return dist::exact_sum(sum, mesh_.data_and_context()) / double(all);
}

// One optimizer step on this rank's share of the batch: forward and backward (through the
// pipeline's stages, micro-batch by micro-batch, when there is one), clipping by the whole
// model's norm (each parameter's placement says how many ranks hold its piece), AdamW. The
// loss (the last stage's; under --reproducible the whole batch's), none elsewhere or under a
// CUDA graph.
std::optional<double> Run::step_loss(const std::vector<Batch>& batches, double& grad_norm) {
  if (graphed_) {
    graphed_->step(batches.front());
    return std::nullopt;
  }
  stepper_->zero_grad();
  std::optional<double> loss;
  if (pipe_) {
    const nn::Inputs in = split_.local_inputs(batches.front().model_inputs());
    const Tensor targets = split_.local_sequence(batches.front().targets);
    const Tensor last = autocast(f_, [&] {
      return pipe_->train_step(in, targets, [this](const Tensor& logits, const Tensor& target) {
        return objective(logits, target);
      });
    });
    if (last.defined()) loss = last.item<double>();
  } else {
    loss = microbatch_losses(batches);
  }
  grad_norm = stepper_->step(*scaler_, f_.clip);
  if (f_.experts > 0) nn::update_expert_biases(*model_);  // loads over data x context
  return loss;
}

// Every --log-every steps: the mean loss since the last line, over the data x context ranks.
void Run::log_step(data::MetricsLogger& metrics, double& grad_norm) {
  if (graphed_) loss_sum_ = graphed_->take_loss_sum(), grad_norm = graphed_->norm();
  // Before the last stage the sum is 0 (no loss): the last stage's count.
  // Under --reproducible every rank holds the whole batch's losses already.
  const double mine = loss_sum_ / double(losses_);
  const double mean =
      f_.reproducible ? mine : parallel::replica_mean(full({1}, mine, {.dtype = kFloat64}), mesh_);
  metrics.log_step({.step = step_,
                    .loss = mean,
                    .lr = scheduler_->lr(),
                    .tokens = tokens_,
                    .grad_norm = grad_norm,
                    .memory = dist::max_memory_stats(device_)});
  if (f_.experts > 0) metrics.log_values(step_, "routing", nn::routing_metrics(*model_));
  loss_sum_ = 0, losses_ = 0, tokens_ = 0;
}

void Run::save() const {
  data::TrainingState state = state_;
  state.user = {{"step", std::to_string(step_)}};
  for (const auto& [key, value] : scaler_->state_dict()) {
    char text[32];  // %.17g: the double comes back bit for bit
    std::snprintf(text, sizeof text, "%.17g", value);
    state.user["scaler." + key] = text;
  }
  parallel::save_sharded_checkpoint(f_.checkpoint, state);
}

// Trains from the checkpoint's step (or 0) to --steps, evaluating, saving and logging on the
// way; then the held-out loss and samples.
int Run::train() {
  resume();
  announce();
  data::MetricsLogger metrics = make_metrics();
  double grad_norm = 0;
  while (step_ < f_.steps) {
    const std::optional<double> loss = step_loss(
        gpt::microbatches(f_, corpus_, mesh_.shape().data, mesh_.data_rank(), step_, device_),
        grad_norm);
    scheduler_->step();
    ++step_;
    loss_sum_ += loss.value_or(0);  // the last stage's
    ++losses_;
    tokens_ += f_.batch * f_.context;
    if (step_ % f_.log_every == 0 || step_ == f_.steps) log_step(metrics, grad_norm);
    if (step_ % f_.eval_every == 0 && step_ < f_.steps)
      metrics.log_eval(step_, "heldout_loss", heldout_loss());
    if (!f_.checkpoint.empty() &&
        (step_ % f_.checkpoint_every == 0 || step_ == f_.steps || step_ == f_.stop_at))
      save();
    if (dist::rank() == 0) std::fflush(stdout);
    const char* restarts = std::getenv("WEAVE_RESTART_COUNT");
    if (step_ == f_.kill_at && dist::rank() == dist::world_size() - 1 &&
        (restarts == nullptr || std::string(restarts) == "0"))
      std::raise(SIGKILL);  // after this step's save, if it saved: the restart resumes there
    if (step_ == f_.stop_at) {
      if (dist::rank() == 0) std::printf("stopped at step %lld\n", static_cast<long long>(step_));
      return 0;
    }
  }
  if (!f_.export_path.empty()) {  // collective under fsdp: every rank gathers, rank 0 writes
    const nn::NamedTensors state = wrapper_->full_state_dict();
    if (dist::rank() == 0) data::save_safetensors(f_.export_path, state);
  }
  const double held = heldout_loss();
  metrics.log_eval(f_.steps, "heldout_loss", held);
  if (dist::rank() == 0) std::printf("heldout_loss=%.4f\n", held);
  sample_lines();
  // Over the whole run: construction, training, evaluation and sampling; the worst rank's.
  const MemoryPeaks worst = dist::max_memory_stats(device_);
  if (dist::rank() == 0)
    std::printf(
        "peak tensor memory %.1f MB (rank %d), peak resident memory %.1f MB (rank %d) "
        "(dist::max_memory_stats)\n",
        double(worst.tensor_peak) / 1e6, worst.tensor_rank, double(worst.resident_peak) / 1e6,
        worst.resident_rank);
  return 0;
}

// Mean loss over the held-out windows: each data-parallel rank evaluates its share (through the
// pipeline's stages when there is one, the loss on the last). Every rank runs as many forwards
// as data rank 0 (the most windows), so that a sharded model's gathers pair up: a rank out of
// windows runs its first again and counts nothing.
double Run::heldout_loss() {
  if (f_.reproducible) return reproducible_heldout_loss();
  NoGradGuard no_grad;
  model_->eval();
  const int data = mesh_.shape().data;
  const int64_t span = int64_t(corpus_.heldout.size()) - f_.context - 1;
  std::vector<int64_t> mine;
  for (int64_t i = mesh_.data_rank(); i < f_.eval_windows; i += data)
    mine.push_back(i * span / f_.eval_windows);
  double total = 0;
  const size_t per_batch = size_t(pipe_ ? f_.batch / data : f_.batch);
  const size_t most = size_t((f_.eval_windows + data - 1) / data);
  for (size_t first = 0; first < most; first += per_batch) {
    const bool spare = first >= mine.size();
    const size_t last = spare ? first + 1 : std::min(mine.size(), first + per_batch);
    const std::vector<int64_t> windows =
        spare ? std::vector<int64_t>{0}
              : std::vector<int64_t>(mine.begin() + long(first), mine.begin() + long(last));
    const Batch batch =
        gpt::make_batch(corpus_.heldout, windows, f_.context, corpus_.end_of_text, device_);
    const nn::Inputs in = split_.local_inputs(batch.model_inputs());
    const Tensor loss = autocast(f_, [&] {
      const Tensor logits = pipe_ ? pipe_->predict(in) : forward(in);
      return logits.defined() ? objective(logits, split_.local_sequence(batch.targets)) : logits;
    });
    if (loss.defined() && !spare)
      total += loss.item<double>() * double(last - first);  // last stage
  }
  // Under context parallelism each rank's loss covers its part of the positions.
  Tensor sum = full({1}, total, {.dtype = kFloat64});
  using parallel::Axis;
  dist::all_reduce(sum, dist::ReduceOp::Sum,
                   mesh_.group({Axis::Data, Axis::Context, Axis::Pipeline}));
  model_->train();
  return sum.item<double>() / double(f_.eval_windows * mesh_.shape().context);
}

// heldout_loss under --reproducible: the windows in chunks of --microbatch dealt by global
// index (the same shapes at any layout), their losses added exactly over the ranks.
double Run::reproducible_heldout_loss() {
  NoGradGuard no_grad;
  model_->eval();
  double total = 0;
  for (const auto& [batch, windows] :
       gpt::heldout_microbatches(f_, corpus_, mesh_.shape().data, mesh_.data_rank(), device_)) {
    const Tensor loss = autocast(f_, [&, &batch = batch] {
      return objective(forward(split_.local_inputs(batch.model_inputs())),
                       split_.local_sequence(batch.targets));
    });
    total += loss.item<double>() * double(windows);
  }
  model_->train();
  return dist::exact_sum(total, mesh_.data_and_context()) / double(f_.eval_windows);
}

// Decoding appends one position at a time, which sequence and context parallelism cannot
// split: then the same parameters go into a model split over the tensor group alone. Every
// rank decodes (a sharded wrapper gathers each unit as it runs); rank 0 prints.
void Run::sample_lines() {
  if (mesh_.shape().expert > 1 || pipe_) {
    if (dist::rank() == 0)
      std::printf("samples: none (the %s)\n",
                  pipe_ ? "blocks are cut into pipeline stages" : "experts are spread over ranks");
    return;
  }
  if (split_.sequence_parallel || split_.context_group) {
    std::optional<parallel::VocabularyGroups> vocabulary = split_.vocabulary;
    if (vocabulary) vocabulary->sequence_parallel = false;  // the same pieces, whole sequences
    std::shared_ptr<nn::CausalLM> decoder =
        gpt::make_model(f_, corpus_.vocab, {.tensor = split_.tensor, .vocabulary = vocabulary});
    decoder->to(device_);
    decoder->load_state_dict(wrapper_->full_state_dict());
    NoGradGuard no_grad;
    sample(*decoder);
  } else {
    wrapper_->run([&] { sample(*model_); });
  }
}

// Lines sampled from a newline, temperature 0.8 (the same draws on every rank).
void Run::sample(nn::CausalLM& model) const {
  if (f_.samples <= 0) return;
  model.eval();
  Generator g(f_.seed + 7);
  const auto newline = std::find(corpus_.chars.begin(), corpus_.chars.end(), '\n');
  std::vector<nn::KVCache> caches = model.make_caches(f_.context);
  Tensor ids = full({f_.samples, 1}, double(newline - corpus_.chars.begin()),
                    {.dtype = kInt64, .device = device_});
  std::vector<std::string> text(size_t(f_.samples));
  for (int64_t t = 0; t + 1 < f_.context; ++t) {
    const Tensor logits = model.forward_cached(ids, caches);
    const Tensor last = logits.select(1, logits.size(1) - 1);
    ids = multinomial(softmax(last.narrow(1, 0, int64_t(corpus_.chars.size())) / 0.8, -1), 1, false,
                      &g);
    const auto drawn = ids.to_vector<int64_t>();
    for (size_t s = 0; s < drawn.size(); ++s) text[s] += char(corpus_.chars[size_t(drawn[s])]);
  }
  if (dist::rank() == 0) {
    std::printf("samples:\n");
    for (const auto& s : text) std::printf("  | %s\n", s.substr(0, s.find('\n')).c_str());
  }
  model.train();
}

// Everything after init: the device, then the run.
int train_and_sample(Flags& f, int argc, char** argv) {
  gpt::check_same_command_line(argc, argv);
  gpt::check_flags(f);
  // Under NCCL the runtime assigned this rank's GPU; under MPI ranks take GPUs round-robin too.
  const Device device = f.device == "cpu" ? kCPU
                        : gpt::uses_nccl(f)
                            ? dist::device()
                            : Device::cuda(dist::local_rank() % std::max(1, cuda::device_count()));
  f.placed = device;
  set_num_threads(f.threads);
  set_float32_matmul_precision(f.matmul_precision);
  if (f.verify_layout) return gpt::verify_layout(f);
  Run run(f, device);
  return run.train();
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  try {
    f = gpt::parse(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  dist::InitGuard distributed(gpt::uses_nccl(f) ? dist::Backend::NCCL : dist::Backend::MPI);
  try {
    return train_and_sample(f, argc, argv);
  } catch (const std::exception& e) {
    dist::exit_with_error(e);  // the error once for the whole job, with the ranks that raised it
  }
}
