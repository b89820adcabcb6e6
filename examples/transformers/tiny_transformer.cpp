// A small decoder-only transformer, tensor parallel across every rank, learning to sort digit
// sequences generated in the program ("3 1 4 1 5 9 2 6 | 1 1 2 3 4 5 6 9"):
//   mpirun -np 2 tiny_transformer [--epochs 8] [--steps 100] [--lr 0.003] [--seed 0]
//
// Each block is an nn::TransformerBlock built with tensor-parallel leaves
// (parallel::tensor_parallel): attention heads are split across the ranks (one fused q/k/v
// projection column parallel, the output projection row parallel, causal fused attention on the
// local heads), so are the MLP's hidden units, the token embedding
// (vocabulary rows) and the output layer (vocabulary columns), whose loss is the
// vocab-parallel cross-entropy: no rank ever holds every logit. The loss counts the sorted
// half only. Rank 0 prints one line per epoch and, last, `final_loss=... uniform=...`
// (uniform: the loss of guessing uniformly over the vocabulary, ln 12).
#include <weave/weave.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>

#include <weave/util/cli.h>

using namespace weave;

namespace {

constexpr int64_t kDigits = 8;             // digits to sort
constexpr int64_t kSeparator = 10;         // token between the digits and their sorted copy
constexpr int64_t kVocab = 12;             // 10 digits, the separator, one unused (divides by 4)
constexpr int64_t kContext = 2 * kDigits;  // inputs: digits, separator, sorted[0..kDigits-2]
constexpr int64_t kModel = 64, kHeads = 4, kHidden = 4 * kModel;

// Sequences [B, 2 * kDigits + 1]: digits, separator, the digits sorted (the same on every rank
// for the same generator).
Tensor make_batch(int64_t batch, Generator& g) {
  Tensor digits = randint(0, 10, {batch, kDigits}, {.dtype = kInt64}, &g);
  std::vector<int64_t> rows = digits.to_vector<int64_t>(), out;
  for (int64_t b = 0; b < batch; ++b) {
    std::vector<int64_t> row(rows.begin() + b * kDigits, rows.begin() + (b + 1) * kDigits);
    out.insert(out.end(), row.begin(), row.end());
    out.push_back(kSeparator);
    std::sort(row.begin(), row.end());
    out.insert(out.end(), row.begin(), row.end());
  }
  return from_vector(out, {batch, 2 * kDigits + 1});
}

class Decoder : public nn::Module {
 public:
  explicit Decoder(const dist::Group& tp, int layers = 2)
      : nn::Module("Decoder"),
        tokens_(register_module(
            "tokens", std::make_shared<parallel::VocabParallelEmbedding>(kVocab, kModel, tp))),
        positions_(register_module("positions", std::make_shared<nn::Embedding>(kContext, kModel))),
        norm_(register_module("norm", std::make_shared<nn::LayerNorm>(Shape{kModel}))),
        head_(register_module(
            "head", std::make_shared<parallel::ColumnParallelLinear>(kModel, kVocab, tp))) {
    WEAVE_CHECK(kHeads % tp.size() == 0, "tiny_transformer",
                "{} heads do not divide among {} ranks; hint: run with 1, 2 or 4 ranks", kHeads,
                tp.size());
    for (int i = 0; i < layers; ++i)
      blocks_.push_back(
          register_module("block" + std::to_string(i),
                          std::make_shared<nn::TransformerBlock>(
                              kModel, kHeads, nn::TransformerBlockOptions{.hidden = kHidden},
                              nn::Leaves{.linears = parallel::tensor_parallel(tp)})));
  }

  /// ids [B, T] -> this rank's slice of the logits [B, T, kVocab / ranks].
  Tensor forward(const Tensor& ids) override {
    Tensor where = arange(0, double(ids.size(1)), 1, {.dtype = kInt64});
    Tensor x = ((*tokens_)(ids) + (*positions_)(where)) * 0.5;  // [B, T, kModel]
    for (auto& block : blocks_) x = (*block)(x);
    return (*head_)((*norm_)(x));
  }

 private:
  std::shared_ptr<parallel::VocabParallelEmbedding> tokens_;
  std::shared_ptr<nn::Embedding> positions_;
  std::shared_ptr<nn::LayerNorm> norm_;
  std::shared_ptr<parallel::ColumnParallelLinear> head_;
  std::vector<std::shared_ptr<nn::TransformerBlock>> blocks_;
};

// Loss over the sorted half: the positions from the separator on predict the next token.
Tensor sorted_half_loss(Decoder& model, const Tensor& sequences, const dist::Group& tp) {
  Tensor inputs = sequences.narrow(1, 0, kContext);
  Tensor logits = model(inputs).narrow(1, kDigits, kDigits);  // [B, kDigits, V / n]
  Tensor targets = sequences.narrow(1, kDigits + 1, kDigits).contiguous().reshape({-1});
  return parallel::vocab_parallel_cross_entropy(logits.reshape({-1, logits.size(2)}), targets, tp);
}

}  // namespace

// Trains and evaluates on every rank of the world.
int train(int epochs, int steps, double lr, uint64_t seed) {
  set_num_threads(1);
  const dist::Group tp = dist::world();
  manual_seed(seed);  // the same on every rank: each keeps its slice of one model
  Decoder model(tp);
  optim::AdamW optimizer(model.parameters(), {.lr = lr, .weight_decay = 0.01});
  const optim::Schedule lr_at =
      optim::linear_warmup(optim::cosine_schedule(lr, int64_t(epochs) * steps), 100);
  Generator train_data(seed + 1), held_out_data(seed + 2);
  const Tensor held_out = make_batch(512, held_out_data);
  const double uniform = std::log(double(kVocab));
  if (dist::rank() == 0)
    std::printf("tiny_transformer: %lld heads over %d ranks, vocab %lld, uniform loss %.4f\n",
                static_cast<long long>(kHeads), tp.size(), static_cast<long long>(kVocab), uniform);
  double held_out_loss = uniform;
  int64_t step = 0;
  for (int epoch = 1; epoch <= epochs; ++epoch) {
    const auto start = std::chrono::steady_clock::now();
    double train_loss = 0;
    for (int s = 0; s < steps; ++s) {
      optimizer.set_lr(lr_at(step++));
      optimizer.zero_grad();
      Tensor loss = sorted_half_loss(model, make_batch(64, train_data), tp);
      loss.backward();
      optimizer.step();
      train_loss += loss.item<double>() / steps;
    }
    {
      NoGradGuard no_grad;
      held_out_loss = sorted_half_loss(model, held_out, tp).item<double>();
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (dist::rank() == 0) {
      std::printf("epoch %d/%d train_loss=%.4f held_out_loss=%.4f uniform=%.4f time=%.1fs\n", epoch,
                  epochs, train_loss, held_out_loss, uniform, seconds);
      std::fflush(stdout);
    }
  }
  if (dist::rank() == 0)
    std::printf("final_loss=%.4f uniform=%.4f ratio=%.3f\n", held_out_loss, uniform,
                held_out_loss / uniform);
  return 0;
}

int main(int argc, char** argv) {
  int epochs = 8, steps = 100;
  double lr = 3e-3;
  uint64_t seed = 0;
  CLI::App app("A tensor-parallel decoder that learns to sort digits.", "tiny_transformer");
  app.option_defaults()->always_capture_default();
  app.add_option("--epochs", epochs)->check(weave::cli::positive());
  app.add_option("--steps", steps, "steps per epoch")->check(weave::cli::positive());
  app.add_option("--lr", lr)->check(weave::cli::positive());
  app.add_option("--seed", seed);
  weave::cli::parse_or_exit(app, argc, argv);
  dist::InitGuard distributed;
  try {
    return train(epochs, steps, lr, seed);
  } catch (const std::exception& e) {
    dist::exit_with_error(e);  // the error once for the whole job, with the ranks that raised it
  }
}
