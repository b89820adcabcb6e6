// Fine-tunes a Hugging Face checkpoint (GPT-2 or a Llama-family model) on text, saves it in
// Hugging Face's format, and generates from a prompt:
//   mpirun -np 2 finetune --model gpt2/ --text notes.txt [--strategy ddp|fsdp|tp|hybrid] [--tp N]
//                         [--context-parallel 1] [--pipeline 1 [--microbatches M]] [--replicate 1]
//                         [--steps 100]
//                         [--context 128] [--batch 8] [--lr 1e-4] [--save gpt2-tuned/]
//                         [--prompt "Once upon"] [--max-new-tokens 40] [--temperature 0.8]
//                         [--top-k 0] [--top-p 0.95] [--seed 0] [--checkpoint-activations]
//                         [--checkpoint DIR [--checkpoint-every 25] [--resume] [--stop-at N]]
// --model holds config.json, model.safetensors (or shards and their index) and the tokenizer
// (tokenizer.json, or vocab.json + merges.txt). --text is a file (or a folder of files, each a
// document; --separator LINE splits files into documents), tokenized by rank 0 into
// <save or model>/train.tokens; --tokens takes a file weave-tokenize wrote instead. Windows of
// --context + 1 tokens (data::TokenDataset) go through a DataLoader with a DistributedSampler
// (each data-parallel rank its share), shuffled by --seed; --checkpoint saves model, optimizer,
// scheduler and loader (sharded), and --resume continues exactly.
// Strategies, as examples/gpt's: ddp (replicas), fsdp (shards; with --replicate R, HSDP: R
// replicas of shard groups), tp (every rank of a context
// group in one tensor-parallel group: models::ModelSplit::from_mesh), hybrid (ddp over
// tensor groups of --tp, 2 by default); --tp N splits the model under ddp and fsdp too, and
// --context-parallel N splits every window over N ranks (zig-zag parts, ring attention) under
// any of them, and --pipeline N cuts the model into N stages (1F1B over --microbatches, 2 N by
// default; GPT-2's last stage holds a copy of the token embedding for its head, its gradient
// added to the first stage's after every step, which takes ddp: fsdp stages need Llama's untied
// head). Each rank reads only the parts of the checkpoint it holds, into a model built without
// memory (nn::DeferredInit).
// --init llama|mistral|mixtral|qwen3|qwen3_moe|gemma2|gemma3|gpt2 first writes a new, randomly
// initialized model of --dim/--layers/--heads/--kv-heads (--head-dim for the Qwen 3 and Gemma
// heads, --window for the sliding windows of Mistral and Gemma's local layers, --experts and
// --experts-per-token for Mixtral's and Qwen 3 MoE's experts) with the tokenizer of --tokenizer DIR
// into
// --model (how the tests make one).
// --lora R trains rank-R adapters (--lora-alpha, 2 R by default; --lora-targets, Hugging Face
// module names or all-linear; --lora-dropout; --lora-rslora) on the base, frozen and kept in
// --base-dtype (bfloat16 halves it; the adapters and their optimizer state stay float32); --save
// then writes the adapters in PEFT's format (adapter_config.json, adapter_model.safetensors), or
// with --merge the model they are merged into. --heldout FILE measures the loss on its windows
// before training, at every log line and at the end (`heldout_loss=X`; no --pipeline).
// Rank 0 prints `step N loss X` (the whole batch's) every --log-every steps, `final_loss=X`,
// `load_peak_bytes=N`, `resident_bytes=N` and `training_peak_bytes=N` (its peak tensor memory
// while building and loading the model, what it holds when training starts, and its peak while
// training: memory_stats), then the worst rank's training peaks, tensor and resident, with
// their ranks (`worst_training_peak_bytes=N (rank R)`, `worst_resident_peak_bytes=...`:
// dist::max_memory_stats),
// and the generated text.
#include <weave/util/cli.h>
#include <weave/weave.h>

#include <cstdio>
#include <filesystem>
#include <optional>

using namespace weave;
namespace fs = std::filesystem;

namespace {

struct Flags {
  std::string model, text, tokens, separator, save, prompt, checkpoint, strategy = "ddp";
  std::string heldout, lora_targets = "all-linear", base_dtype = "float32";
  int64_t lora = 0;
  double lora_alpha = 0, lora_dropout = 0;
  bool lora_rslora = false, merge = false;
  int tp = 0, context_parallel = 1, pipeline = 1, microbatches = 0, replicate = 1;
  std::string init, tokenizer;
  int64_t steps = 100, context = 128, batch = 8, log_every = 10, checkpoint_every = 25;
  int64_t stop_at = -1, max_new_tokens = 40, top_k = 0, dim = 64, layers = 2, heads = 4;
  int64_t kv_heads = 2;
  int64_t head_dim = 0, window = 16, experts = 4, experts_per_token = 2;
  double lr = 1e-4, temperature = 0.8, top_p = 0.95;
  uint64_t seed = 0;
  bool resume = false, checkpoint_activations = false;
};

Flags parse(int argc, char** argv) {
  Flags f;
  CLI::App app("Fine-tunes a Hugging Face checkpoint, saves it, and generates.", "finetune");
  app.add_option("--model", f.model, "the checkpoint directory")->required();
  app.add_option("--text", f.text, "text file or folder to train on");
  app.add_option("--tokens", f.tokens, "a token file (weave-tokenize) to train on");
  app.add_option("--separator", f.separator, "a line separating documents in --text files");
  app.add_option("--strategy", f.strategy, "ddp, fsdp, tp or hybrid (ddp x tp)")
      ->check(CLI::IsMember({"ddp", "fsdp", "tp", "hybrid"}));
  app.add_option("--tp", f.tp, "tensor-parallel group size (0: 2 under hybrid, else 1)")
      ->check(cli::non_negative());
  app.add_option("--context-parallel", f.context_parallel, "ranks that split each window")
      ->check(cli::positive());
  app.add_option("--pipeline", f.pipeline, "pipeline stages (consecutive blocks, 1F1B)")
      ->check(cli::positive());
  app.add_option("--microbatches", f.microbatches, "per step and data rank (0: 2 x --pipeline)")
      ->check(cli::non_negative());
  app.add_option("--replicate", f.replicate,
                 "fsdp: HSDP, the data ranks as this many replicas of shard groups")
      ->check(cli::positive());
  app.add_option("--steps", f.steps)->check(cli::non_negative());
  app.add_option("--context", f.context)->check(cli::positive());
  app.add_option("--batch", f.batch, "windows per step, over all ranks")->check(cli::positive());
  app.add_option("--lr", f.lr)->check(cli::positive());
  app.add_option("--log-every", f.log_every)->check(cli::positive());
  app.add_option("--save", f.save, "write the tuned model here, in Hugging Face's format");
  app.add_option("--prompt", f.prompt, "generate from it after training");
  app.add_option("--max-new-tokens", f.max_new_tokens)->check(cli::non_negative());
  app.add_option("--temperature", f.temperature, "0: greedy")->check(cli::non_negative());
  app.add_option("--top-k", f.top_k)->check(cli::non_negative());
  app.add_option("--top-p", f.top_p)->check(CLI::Range(1e-9, 1.0));
  app.add_option("--seed", f.seed);
  app.add_option("--checkpoint", f.checkpoint, "sharded training checkpoints here");
  app.add_option("--checkpoint-every", f.checkpoint_every)->check(cli::positive());
  app.add_flag("--resume", f.resume, "continue from --checkpoint");
  app.add_flag("--checkpoint-activations", f.checkpoint_activations,
               "recompute each block in backward instead of keeping its activations");
  app.add_option("--stop-at", f.stop_at, "stop after this step (checkpointed)");
  app.add_option("--init", f.init,
                 "write a new llama, mistral, qwen3, gemma2, gemma3 or gpt2 model into --model")
      ->check(CLI::IsMember(
          {"llama", "mistral", "mixtral", "qwen3", "qwen3_moe", "gemma2", "gemma3", "gpt2"}));
  app.add_option("--head-dim", f.head_dim, "--init qwen3/gemma: each head's size (0: dim / heads)")
      ->check(cli::non_negative());
  app.add_option("--window", f.window, "--init mistral/gemma: the sliding window")
      ->check(cli::positive());
  app.add_option("--experts", f.experts, "--init mixtral/qwen3_moe: experts a block")
      ->check(cli::positive());
  app.add_option("--experts-per-token", f.experts_per_token,
                 "--init mixtral/qwen3_moe: experts a token")
      ->check(cli::positive());
  app.add_option("--tokenizer", f.tokenizer, "--init: the tokenizer's directory");
  app.add_option("--heldout", f.heldout, "text to measure the held-out loss on")
      ->check(CLI::ExistingFile);
  app.add_option("--lora", f.lora, "train rank-R adapters on a frozen base (0: every parameter)")
      ->check(cli::non_negative());
  app.add_option("--lora-alpha", f.lora_alpha, "the adapters' alpha (0: 2 x --lora)")
      ->check(cli::non_negative());
  app.add_option("--lora-targets", f.lora_targets,
                 "Hugging Face modules to adapt, comma-separated, or all-linear");
  app.add_option("--lora-dropout", f.lora_dropout)->check(CLI::Range(0.0, 0.99));
  app.add_flag("--lora-rslora", f.lora_rslora, "scale by alpha / sqrt(r)");
  app.add_flag("--merge", f.merge, "--lora: --save the merged model, not the adapters");
  app.add_option("--base-dtype", f.base_dtype, "--lora: the frozen base's dtype")
      ->check(CLI::IsMember({"float32", "bfloat16", "float16"}));
  for (auto [name, value] : {std::pair{"--dim", &f.dim},
                             {"--layers", &f.layers},
                             {"--heads", &f.heads},
                             {"--kv-heads", &f.kv_heads}})
    app.add_option(name, *value, "--init's shape")->check(cli::positive());
  cli::parse_or_exit(app, argc, argv);
  return f;
}

// Gemma's settings as its published configs hold them: Gemma 2's soft-caps and alternating
// local and global layers, Gemma 3's q/k norms, five local layers to a global one and a local
// rotary base; the head tied.
void set_gemma(data::hf::ModelConfig& config, const Flags& f) {
  const bool gemma3 = f.init == "gemma3";
  config.architecture = "gemma", config.tie_embeddings = true, config.qk_norm = gemma3;
  config.head_dim = f.head_dim > 0 ? f.head_dim : f.dim / f.heads;
  config.query_pre_attn_scalar = double(config.head_dim), config.sliding_window = f.window;
  config.norm_eps = 1e-6, config.rope_theta = gemma3 ? 1e6 : 1e4;
  config.rope_local_theta = gemma3 ? 1e4 : 0;
  config.attention_softcap = gemma3 ? 0 : 50, config.logit_softcap = gemma3 ? 0 : 30;
  for (int64_t i = 0; i < config.layers; ++i)
    config.windowed_layers.push_back((i + 1) % (gemma3 ? 6 : 2) != 0);
}

// --init: a new model and the tokenizer's files, on rank 0.
void write_new_model(const Flags& f) {
  if (dist::rank() == 0) {
    WEAVE_CHECK(!f.tokenizer.empty(), "finetune", "--init needs --tokenizer DIR");
    const auto tok = data::Tokenizer::from_directory(f.tokenizer);
    data::hf::ModelConfig config;
    config.architecture = f.init == "gpt2" ? "gpt2" : "llama";
    // The tokenizer's (tensor parallelism pads it where the ranks do not divide it).
    config.vocab = tok.vocab_size(), config.dim = f.dim, config.layers = f.layers;
    config.heads = f.heads, config.kv_heads = f.init == "gpt2" ? f.heads : f.kv_heads;
    config.hidden = f.init == "gpt2" ? 4 * f.dim : models::llama_hidden(f.dim);
    config.max_positions = 1024, config.tie_embeddings = f.init == "gpt2";
    const bool qwen3 = f.init.starts_with("qwen3");
    config.qk_norm = qwen3, config.head_dim = qwen3 ? f.head_dim : 0;
    if (f.init == "mixtral" || f.init == "qwen3_moe") {
      config.experts = f.experts, config.experts_per_token = f.experts_per_token;
      config.expert_hidden = config.hidden, config.router_aux_loss_coef = 0.001;
    }
    if (f.init == "mistral") config.sliding_window = f.window;
    if (f.init.starts_with("gemma")) set_gemma(config, f);
    Generator generator(f.seed);
    auto model = models::make_model(config, {}, &generator);
    {  // embeddings at Hugging Face's initializer_range (0.02), as its new models start
      NoGradGuard no_grad;
      for (auto& [name, p] : model->named_parameters())
        if (name == "tokens.weight" || name == "positions.weight" || name == "embedding.weight")
          p.copy_(randn(p.shape(), {.dtype = p.dtype()}, &generator) * 0.02);
    }
    data::hf::save_pretrained(*model, config, f.model, {.tokenizer = &tok});
    std::printf("wrote a new %s model (vocab %lld, dim %lld) to %s\n", f.init.c_str(),
                static_cast<long long>(config.vocab), static_cast<long long>(f.dim),
                f.model.c_str());
  }
  dist::barrier();
}

// --text: the documents tokenized by rank 0 into a token file the others then open.
// --heldout likewise into heldout.tokens.
std::string token_file(const Flags& f, const data::Tokenizer& tok, bool heldout = false) {
  if (!f.tokens.empty() && !heldout) return f.tokens;
  WEAVE_CHECK(!f.text.empty() || heldout, "finetune",
              "give --text FILE or --tokens FILE to train on");
  const std::string out =
      (f.save.empty() ? f.model : f.save) + (heldout ? "/heldout.tokens" : "/train.tokens");
  if (dist::rank() == 0) {
    fs::create_directories(fs::path(out).parent_path());
    const data::TokenizeStats stats = data::write_token_file(
        out, data::files_in(heldout ? f.heldout : f.text, {".dat"}), tok,
        {.separator = f.separator, .end_of_text = tok.end_of_text().has_value()});
    std::printf("tokenized %lld documents: %lld tokens\n", static_cast<long long>(stats.documents),
                static_cast<long long>(stats.tokens));
  }
  dist::barrier();
  return out;
}

// How the ranks split the work (tensor x context x data): tp puts every rank of a context group
// in one tensor group, the others make tensor groups of --tp (hybrid: 2 by default).
parallel::MeshShape mesh_shape(const Flags& f) {
  const int world = dist::world_size(), context = f.context_parallel, pipeline = f.pipeline;
  const int tensor = f.strategy == "tp"       ? world / (context * pipeline)
                     : f.tp > 0               ? f.tp
                     : f.strategy == "hybrid" ? 2
                                              : 1;
  WEAVE_CHECK(tensor > 0 && world % (context * tensor * pipeline) == 0, "finetune",
              "--context-parallel {} times --pipeline {} times {} tensor-parallel ranks does not "
              "divide the {} ranks",
              context, pipeline, tensor, world);
  WEAVE_CHECK(f.context % (2 * context) == 0, "finetune",
              "--context {} must split into 2 x --context-parallel {} equal chunks (zig-zag)",
              f.context, context);
  const int data = world / (context * tensor * pipeline);
  WEAVE_CHECK(f.replicate == 1 || (f.strategy == "fsdp" && data % f.replicate == 0), "finetune",
              "--replicate {} (HSDP) needs --strategy fsdp and must divide the {} data ranks",
              f.replicate, data);
  return {.data = data,
          .tensor = tensor,
          .pipeline = pipeline,
          .context = context,
          .replicate = f.replicate};
}

// What one rank trains: the model (whole, or its part) and its wrapper, the optimizer, the
// loader over the token windows, and the state a checkpoint keeps.
struct Trainer {
  Trainer(const Flags& flags, const data::hf::ModelConfig& model_config,
          const data::Tokenizer& tokenizer)
      : f(flags),
        config(model_config),
        mesh(mesh_shape(f)),
        sharded(f.strategy == "fsdp"),
        parts(models::ModelSplit::from_mesh(mesh)),
        dataset(std::make_shared<const data::TokenDataset>(
            std::make_shared<const data::TokenFile>(token_file(f, tokenizer)),
            data::TokenWindows{.context = f.context})),
        sampler(std::make_shared<parallel::DistributedSampler>(
            dataset->size(), mesh.shape().data, mesh.data_rank(),
            parallel::DistributedSamplerOptions{.seed = f.seed})) {
    const int replicas = mesh.shape().data;
    WEAVE_CHECK(f.batch % replicas == 0, "finetune", "--batch {} does not divide among {} ranks",
                f.batch, replicas);
    loader = std::make_unique<data::DataLoader>(
        dataset, data::DataLoaderOptions{
                     .batch_size = f.batch / replicas, .drop_last = true, .sampler = sampler});
    if (!f.heldout.empty()) {
      WEAVE_CHECK(mesh.shape().pipeline == 1, "finetune",
                  "--heldout is measured without a pipeline; hint: drop --pipeline");
      heldout = std::make_shared<const data::TokenDataset>(
          std::make_shared<const data::TokenFile>(token_file(f, tokenizer, true)),
          data::TokenWindows{.context = f.context});
    }
    build_model();
    optimizer = std::make_unique<optim::AdamW>(wrapper->trained_parameters(),
                                               optim::AdamWOptions{.lr = f.lr});
    scheduler =
        std::make_unique<optim::LRScheduler>(*optimizer, [lr = f.lr](int64_t) { return lr; });
    state = {.model = &trained(),
             .optimizer = optimizer.get(),
             .scheduler = scheduler.get(),
             .loader = loader.get()};
    if (f.resume && !f.checkpoint.empty() && fs::exists(fs::path(f.checkpoint) / "index.json")) {
      parallel::load_sharded_checkpoint(f.checkpoint, state);
      step = std::stoll(state.user.at("step")), epoch = std::stoll(state.user.at("epoch"));
      sampler->set_epoch(epoch);
      if (dist::rank() == 0) std::printf("resumed at step %lld\n", static_cast<long long>(step));
    }
  }

  // The model and its wrapper, each rank reading only the parts it holds: its tensor-parallel
  // slices, or under fsdp its shards of them. Built without memory: the load allocates what it
  // reads.
  void build_model() {
    {  // FSDP's shards are allocated, not drawn: the load fills them
      auto deferred = nn::DeferredInit::for_loading();
      model = models::make_model(config, parts);
    }
    model->set_recompute_blocks(f.checkpoint_activations);
    // DDP's replicas load before it starts (its broadcast finds them equal); FSDP's units (each
    // block, the embeddings, norm and head; tied: the root) load into this rank's shards. A base
    // under adapters loads before too: FSDP shards what trains, the adapters.
    const bool load_first = !sharded || f.lora > 0;
    if (load_first) parallel::load_pretrained(*model, config, f.model);
    if (f.lora > 0) add_adapters();
    wrapper = parallel::data_parallel(
        *model, mesh,
        {.shard = sharded, .fsdp = {.reshard_after_forward = mesh.shape().pipeline == 1}});
    if (!load_first) parallel::load_pretrained(trained(), config, f.model);
    if (mesh.shape().pipeline > 1)
      pipe = std::make_unique<parallel::Pipeline>(
          *wrapper,
          parallel::PipelineOptions{
              .microbatches = f.microbatches > 0 ? f.microbatches : 2 * mesh.shape().pipeline,
              .group = mesh.pipeline()});
  }

  // --lora: the base in --base-dtype, frozen, and adapters on the --lora-targets.
  void add_adapters() {
    if (f.base_dtype != "float32") model->to(f.base_dtype == "bfloat16" ? kBFloat16 : kFloat16);
    std::vector<std::string> modules;
    for (size_t at = 0; at <= f.lora_targets.size();) {
      const size_t comma = std::min(f.lora_targets.find(',', at), f.lora_targets.size());
      if (comma > at) modules.push_back(f.lora_targets.substr(at, comma - at));
      at = comma + 1;
    }
    lora = {.rank = f.lora,
            .alpha = f.lora_alpha > 0 ? f.lora_alpha : 2.0 * double(f.lora),
            .rslora = f.lora_rslora,
            .dropout = f.lora_dropout,
            .targets = models::peft_targets(config, modules),
            .seed = f.seed};
    nn::add_lora(*model, lora, /*every_target=*/false);  // a stage holds some blocks
    const nn::ParameterCount count = nn::count_parameters(*model);
    if (dist::rank() == 0)
      std::printf("lora: rank %lld on %zu projections: %lld trainable, %lld frozen parameters\n",
                  static_cast<long long>(f.lora), nn::lora_adapters(*model).size(),
                  static_cast<long long>(count.trainable),
                  static_cast<long long>(count.total - count.trainable));
  }

  // The mean next-token loss over the held-out windows, each data rank its share (no pipeline).
  double heldout_loss() {
    NoGradGuard no_grad;
    model->eval();
    double sum = 0;
    const int64_t replicas = mesh.shape().data, per_rank = f.batch / replicas;
    const int64_t batches = heldout->size() / f.batch;  // the same count on every rank
    for (int64_t b = 0; b < batches; ++b) {
      std::vector<int64_t> rows;
      for (int64_t i = 0; i < per_rank; ++i)
        rows.push_back(b * f.batch + mesh.data_rank() * per_rank + i);
      const data::Example batch = heldout->get_batch(rows);
      Tensor logits;
      wrapper->run([&] { logits = (*model)(parts.local_inputs(batch.model_inputs())); });
      sum += parts.cross_entropy(logits, parts.local_sequence(batch.target)).item<double>();
    }
    model->train();
    WEAVE_CHECK(batches > 0, "finetune", "--heldout holds fewer than --batch {} windows", f.batch);
    return parallel::replica_mean(full({1}, sum / double(batches), {.dtype = kFloat64}), mesh);
  }

  // One optimizer step on a batch; returns its loss (the whole batch's).
  double step_on(const data::Example& batch) {
    optimizer->zero_grad();
    const nn::Inputs in = parts.local_inputs(batch.model_inputs());  // this rank's positions
    const Tensor targets = parts.local_sequence(batch.target);
    Tensor loss;
    if (pipe) {  // every micro-batch's forward and backward; the loss on the last stage
      loss = pipe->train_step(in, targets, [this](const Tensor& logits, const Tensor& target) {
        return parts.cross_entropy(logits, target);
      });
    } else {
      loss = parts.cross_entropy(wrapper->forward(in), targets);
      loss.backward();
    }
    optimizer->step();
    scheduler->step();
    return parallel::replica_mean(loss, mesh);  // the last stage's, over the replicas
  }

  // Trains to --steps (false: stopped at --stop-at, checkpointed).
  bool train() {
    while (step < f.steps) {
      for (const data::Example& batch : *loader) {
        last_loss = step_on(batch);
        ++step;
        if (step % f.log_every == 0) {
          const double held = heldout ? heldout_loss() : 0;
          if (dist::rank() == 0 && heldout)
            std::printf("step %lld loss %.6f heldout %.6f\n", static_cast<long long>(step),
                        last_loss, held);
          else if (dist::rank() == 0)
            std::printf("step %lld loss %.6f\n", static_cast<long long>(step), last_loss);
        }
        const bool stop = step == f.stop_at || step == f.steps;
        if (!f.checkpoint.empty() && (step % f.checkpoint_every == 0 || stop)) {
          state.user = {{"step", std::to_string(step)}, {"epoch", std::to_string(epoch)}};
          parallel::save_sharded_checkpoint(f.checkpoint, state);
        }
        if (step == f.stop_at) return false;
        if (stop) break;
      }
      if (step < f.steps) sampler->set_epoch(++epoch);
    }
    return true;
  }

  // The whole model of a split one on rank 0, put together one tensor at a time from the ranks'
  // slices, shards and stages (null elsewhere; collective).
  std::shared_ptr<nn::CausalLM> whole_model() {
    nn::NamedTensors state = parallel::gather_whole_state_dict(trained());
    if (dist::rank() != 0) return nullptr;
    auto whole = models::make_model(config);
    whole->load_state_dict(state);
    return whole;
  }

  // What checkpoints and exports read: the wrapper's (fsdp: this rank's shards), or the model.
  nn::Module& trained() { return wrapper->sharded_module(); }

  const Flags& f;
  const data::hf::ModelConfig& config;
  parallel::ProcessMesh mesh;
  bool sharded;
  models::ModelSplit parts;  // this rank's part of the model (empty on one replica)
  std::shared_ptr<const data::TokenDataset> dataset;
  std::shared_ptr<parallel::DistributedSampler> sampler;
  std::shared_ptr<const data::TokenDataset> heldout;  // --heldout's windows, or null
  std::shared_ptr<nn::CausalLM> model;
  nn::LoRAOptions lora;  // --lora's adapters
  std::unique_ptr<data::DataLoader> loader;
  // DDP over the data x context replicas, FSDP sharding over them (HSDP with --replicate), or
  // on one replica the model itself (parallel::data_parallel).
  std::unique_ptr<parallel::DataParallelWrapper> wrapper;
  std::unique_ptr<parallel::Pipeline> pipe;
  std::unique_ptr<optim::AdamW> optimizer;
  std::unique_ptr<optim::LRScheduler> scheduler;
  data::TrainingState state;
  int64_t step = 0, epoch = 0;
  double last_loss = 0;
};

// The tuned model in Hugging Face's format: rank 0 writes it one parameter at a time, put
// together from the ranks' slices and shards (no rank builds the whole model).
// --lora: the adapters in PEFT's format, or with --merge the model they are merged into.
void save(const Flags& f, Trainer& trainer, const data::Tokenizer& tok) {
  if (f.lora > 0 && !f.merge) {
    models::save_adapters(trainer.trained(), trainer.config, trainer.lora, f.save,
                          {.base_model = f.model});
    if (dist::rank() == 0) std::printf("saved adapters to %s\n", f.save.c_str());
    return;
  }
  if (f.lora > 0) nn::merge_lora(*trainer.model);  // each rank its pieces
  models::save_pretrained(trainer.trained(), trainer.config, f.save, {.tokenizer = &tok});
  if (dist::rank() == 0) std::printf("saved %s\n", f.save.c_str());
}

void save_and_generate(const Flags& f, Trainer& trainer, const data::Tokenizer& tok) {
  if (!f.save.empty()) save(f, trainer, tok);
  if (f.prompt.empty()) return;
  const auto ids = tok.encode(f.prompt);
  const Tensor prompt =
      from_vector(std::vector<int64_t>(ids.begin(), ids.end()), {1, int64_t(ids.size())});
  const nn::GenerationOptions options{.max_new_tokens = f.max_new_tokens,
                                      .temperature = f.temperature,
                                      .top_k = f.top_k,
                                      .top_p = f.top_p,
                                      .seed = f.seed,
                                      .end_of_text = tok.end_of_text()};
  // Under tp every rank decodes its part; under fsdp every rank decodes through its shards, each
  // block gathered in turn (no rank holds the whole model); otherwise rank 0 decodes the whole
  // model (the split ones gathered first).
  const parallel::MeshShape& shape = trainer.mesh.shape();
  const bool tp_decode = f.strategy == "tp" && shape.context == 1 && shape.pipeline == 1;
  const bool whole = trainer.parts.whole() && !trainer.parts.context_group;
  Tensor out;
  if (tp_decode) {
    out = nn::generate(*trainer.model, prompt, options);
  } else if (whole) {  // every replica decodes (fsdp: each block gathered in turn)
    trainer.wrapper->run([&] { out = nn::generate(*trainer.model, prompt, options); });
  } else {
    const std::shared_ptr<nn::CausalLM> whole = trainer.whole_model();
    if (dist::rank() == 0) out = nn::generate(*whole, prompt, options);
  }
  if (dist::rank() == 0) {
    const Tensor row = out.select(0, 0).contiguous();
    const std::vector<int32_t> all(row.data<int64_t>(), row.data<int64_t>() + row.numel());
    std::printf("generated: %s\n", tok.decode(all).c_str());
  }
}

int run(const Flags& f) {
  WEAVE_CHECK(!f.merge || (f.lora > 0 && f.strategy != "fsdp"), "finetune",
              "--merge folds --lora's adapters into the base, which FSDP's shards do not hold "
              "whole; hint: --save the adapters, then models::load_adapters into the model "
              "and nn::merge_lora");
  WEAVE_CHECK(f.lora > 0 || f.base_dtype == "float32", "finetune",
              "--base-dtype {} is the frozen base's under --lora", f.base_dtype);
  if (!f.init.empty()) write_new_model(f);
  const auto config = data::hf::read_config(f.model);
  const auto tok = data::Tokenizer::from_directory(f.model);
  WEAVE_CHECK(tok.vocab_size() <= config.vocab, "finetune",
              "the tokenizer has {} tokens, the model's vocabulary {}", tok.vocab_size(),
              config.vocab);
  Trainer trainer(f, config, tok);
  if (dist::rank() == 0)
    std::printf("load_peak_bytes=%lld\nresident_bytes=%lld\n",
                static_cast<long long>(memory_stats().peak),
                static_cast<long long>(memory_stats().in_use));
  if (trainer.heldout) {
    const double before = trainer.heldout_loss();
    if (dist::rank() == 0) std::printf("heldout_loss_before=%.6f\n", before);
  }
  reset_peak_memory();  // training's peak, not loading's
  if (!trainer.train()) {
    if (dist::rank() == 0)
      std::printf("stopped at step %lld\n", static_cast<long long>(trainer.step));
    return 0;
  }
  const MemoryPeaks worst = dist::max_memory_stats();  // training's, over every rank
  if (dist::rank() == 0)
    std::printf(
        "final_loss=%.6f\ntraining_peak_bytes=%lld\nworst_training_peak_bytes=%lld (rank %d)\n"
        "worst_resident_peak_bytes=%lld (rank %d)\n",
        trainer.last_loss, static_cast<long long>(memory_stats().peak),
        static_cast<long long>(worst.tensor_peak), worst.tensor_rank,
        static_cast<long long>(worst.resident_peak), worst.resident_rank);
  if (trainer.heldout) {
    const double after = trainer.heldout_loss();
    if (dist::rank() == 0) std::printf("heldout_loss=%.6f\n", after);
  }
  save_and_generate(f, trainer, tok);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Flags f = parse(argc, argv);
  dist::InitGuard distributed;
  try {
    return run(f);
  } catch (const std::exception& e) {
    dist::exit_with_error(e);
  }
}
