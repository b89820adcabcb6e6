#include "weave/nn/generation.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "weave/autograd/grad_mode.h"

namespace weave::nn {
namespace {

constexpr const char* kGenerate = "generate";

// One row's token: the argmax, or a draw from the softmax of logits / temperature restricted to
// the top-k and then the top-p nucleus.
int64_t pick(const float* logits, int64_t vocab, const GenerationOptions& options, double draw) {
  if (options.temperature == 0) return int64_t(std::max_element(logits, logits + vocab) - logits);
  std::vector<int64_t> order(static_cast<size_t>(vocab));
  std::iota(order.begin(), order.end(), 0);
  // Most likely first; equal logits by id, so the order (and the draw) never depends on sort.
  const auto before = [&](int64_t a, int64_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  const int64_t keep = options.top_k > 0 ? std::min(options.top_k, vocab) : vocab;
  std::partial_sort(order.begin(), order.begin() + keep, order.end(), before);
  order.resize(size_t(keep));
  std::vector<double> probs(order.size());
  const double top = logits[order[0]];
  double total = 0;
  for (size_t i = 0; i < order.size(); ++i)
    total += probs[i] = std::exp((double(logits[order[i]]) - top) / options.temperature);
  size_t nucleus = order.size();
  if (options.top_p < 1) {
    double sum = 0;
    for (nucleus = 0; nucleus < order.size();)
      if ((sum += probs[nucleus++] / total) >= options.top_p) break;
    total = std::accumulate(probs.begin(), probs.begin() + std::ptrdiff_t(nucleus), 0.0);
  }
  double target = draw * total;
  for (size_t i = 0; i < nucleus; ++i)
    if ((target -= probs[i]) < 0) return order[i];
  return order[nucleus - 1];  // rounding left a sliver past the last
}

}  // namespace

Tensor sample_tokens(const Tensor& logits, const GenerationOptions& options,
                     const std::vector<double>& draws) {
  WEAVE_CHECK(logits.dim() == 2 && int64_t(draws.size()) == logits.size(0), kGenerate,
              "expected logits [B, vocab] and B draws, found {} and {}", logits.shape(),
              draws.size());
  const Tensor host = logits.to(kCPU).to(kFloat32).contiguous();
  const int64_t rows = host.size(0), vocab = host.size(1);
  // -inf bans a token; NaN says the model broke, and sampling from it would go on silently.
  // Checked on the host copy the sampling reads anyway: no pass or sync more on a GPU.
  const float* values = host.data<float>();
  const int64_t nan_at =
      std::find_if(values, values + rows * vocab, [](float v) { return std::isnan(v); }) - values;
  WEAVE_CHECK(nan_at == rows * vocab, kGenerate,
              "the logits of row {} hold NaN (first at token {}); hint: the model's weights or "
              "activations overflowed (check the weights with all_finite, or run in float32)",
              nan_at / std::max<int64_t>(vocab, 1), nan_at % std::max<int64_t>(vocab, 1));
  std::vector<int64_t> picked(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r)
    picked[size_t(r)] = pick(host.data<float>() + r * vocab, vocab, options, draws[size_t(r)]);
  return from_vector(picked, {rows}, logits.device());
}

Tensor generate(CausalLM& model, const Tensor& prompt, const GenerationOptions& options) {
  WEAVE_CHECK(
      prompt.defined() && prompt.dim() == 2 && prompt.size(1) > 0 && prompt.dtype() == kInt64,
      kGenerate, "expected an int64 prompt [B, T0] with T0 > 0, found {}",
      prompt.defined() ? prompt.shape() : Shape{});
  WEAVE_CHECK(options.max_new_tokens >= 0 && options.temperature >= 0 && options.top_k >= 0 &&
                  options.top_p > 0 && options.top_p <= 1,
              kGenerate,
              "expected max_new_tokens >= 0, temperature >= 0, top_k >= 0 and top_p in (0, 1], "
              "found {}, {}, {} and {}",
              options.max_new_tokens, options.temperature, options.top_k, options.top_p);
  NoGradGuard no_grad;
  const int64_t lowest = min(prompt).item<int64_t>(), highest = max(prompt).item<int64_t>();
  WEAVE_CHECK(lowest >= 0 && highest < model.vocab(), kGenerate,
              "prompt ids must lie in [0, {}) (the model's vocabulary), found [{}, {}]",
              model.vocab(), lowest, highest);
  const bool was_training = model.is_training();
  model.eval();
  const int64_t rows = prompt.size(0);
  std::vector<KVCache> caches = model.make_caches(prompt.size(1) + options.max_new_tokens);
  std::mt19937_64 engine(options.seed);
  std::vector<Tensor> pieces{prompt};
  std::vector<bool> stopped(static_cast<size_t>(rows), false);
  Tensor next_input = prompt;
  for (int64_t step = 0; step < options.max_new_tokens; ++step) {
    Tensor logits = model.forward_cached(next_input, caches);
    logits = logits.select(1, logits.size(1) - 1);
    std::vector<double> draws(static_cast<size_t>(rows));
    for (double& d : draws) d = double(engine() >> 11) * 0x1.0p-53;  // the same on any library
    Tensor chosen = sample_tokens(logits, options, draws).to(kCPU);
    auto* ids = chosen.data<int64_t>();
    bool all_stopped = true;
    for (int64_t r = 0; r < rows; ++r) {
      if (stopped[size_t(r)]) ids[r] = *options.end_of_text;
      if (options.end_of_text && ids[r] == *options.end_of_text) stopped[size_t(r)] = true;
      all_stopped = all_stopped && stopped[size_t(r)];
    }
    next_input = chosen.reshape({rows, 1}).to(prompt.device());
    pieces.push_back(next_input);
    if (all_stopped) break;
  }
  if (was_training) model.train();
  return cat(pieces, 1);
}

}  // namespace weave::nn
