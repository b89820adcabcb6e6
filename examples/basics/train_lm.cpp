// Your own language-model trainer, in one screen: a new Llama-class model trained on a token
// file (weave-tokenize's output) under FSDP on every rank of an mpirun job, with clipping,
// progress lines, a sharded checkpoint and a Hugging Face export with its tokenizer.
//   weave-tokenize --tokenizer gpt2/ -o corpus.tokens texts/
//   mpirun -np 2 train_lm corpus.tokens gpt2/ out/ [steps]
#include <weave/weave.h>

using namespace weave;

int main(int argc, char** argv) {
  dist::InitGuard guard;  // under mpirun: every rank; else a world of one
  if (argc < 4) return std::fprintf(stderr, "usage: train_lm TOKENS TOKENIZER OUT [STEPS]\n"), 2;
  const int64_t steps = argc > 4 ? std::atoll(argv[4]) : 200, context = 128, batch = 4;
  auto tokens = std::make_shared<data::TokenFile>(argv[1]);
  auto windows = std::make_shared<data::TokenDataset>(
      tokens, data::TokenWindows{.context = context, .pack = true});  // documents kept apart
  auto sampler = std::make_shared<parallel::DistributedSampler>(windows->size());
  data::DataLoader loader(windows, {.batch_size = batch, .sampler = sampler});

  const models::LlamaOptions options{
      .vocab = tokens->vocab_size(), .dim = 128, .layers = 4, .block = {.heads = 4, .kv_heads = 2}};
  std::shared_ptr<models::Llama> model;
  {
    nn::DeferredInit deferred(/*seed=*/0);  // no memory yet: values are drawn by name, later
    model = std::make_shared<models::Llama>(options);
  }
  if (dist::rank() == 0) std::printf("%s", nn::summary(*model, 1).c_str());
  parallel::FullyShardedDataParallel fsdp(*model);  // each rank draws its 1/N; a unit per block
  optim::AdamW opt(fsdp.param_groups(optim::weight_decay_groups(*model, 0.1)), {.lr = 1e-3});
  data::MetricsLogger metrics({.enabled = dist::rank() == 0, .total_steps = steps});

  for (int64_t step = 1, epoch = 0; step <= steps; ++epoch) {
    sampler->set_epoch(epoch);
    for (const data::Example& batch : loader) {
      Tensor logits = fsdp(batch.model_inputs());  // [B, T, vocab]
      Tensor loss = cross_entropy(logits.flatten(0, 1), batch.target.flatten());
      opt.zero_grad();
      loss.backward();                                // gradients reduce-scattered as they come
      const double norm = fsdp.clip_grad_norm_(1.0);  // the whole model's norm
      opt.step();
      metrics.log_step({.step = step,
                        .loss = loss.item(),  // this rank's batch's loss
                        .tokens = batch.input.numel() * dist::world_size(),
                        .grad_norm = norm});
      if (++step > steps) break;
    }
  }
  data::TrainingState state{.model = &fsdp.sharded_module(), .optimizer = &opt};
  parallel::save_sharded_checkpoint(std::string(argv[3]) + "/checkpoint", state);
  const auto tokenizer = data::Tokenizer::from_directory(argv[2]);
  // Collective: rank 0 writes one whole parameter at a time, put together from the shards.
  models::save_pretrained(fsdp.sharded_module(), models::model_config(options),
                          std::string(argv[3]) + "/model", {.tokenizer = &tokenizer});
  if (dist::rank() == 0) std::printf("exported %s/model\n", argv[3]);
}
