// Mixture of experts: top-k routing with capacity, the auxiliary losses, and the dispatch and
// combine that every layout of the experts shares.
#include "weave/nn/moe.h"

#include <cmath>

#include "weave/autograd/grad_mode.h"
#include "weave/nn/layers.h"
#include "weave/nn/transformer.h"
#include "weave/ops/ops.h"
#include "weave/ops/side_loss.h"

namespace weave::nn {

namespace {

constexpr const char* kRouter = "TopKRouter";

void check_router(int64_t hidden, const RouterOptions& o) {
  WEAVE_CHECK(hidden >= 1, kRouter, "hidden must be at least 1, found {}", hidden);
  WEAVE_CHECK(o.experts >= 1, kRouter, "experts must be at least 1, found {}", o.experts);
  WEAVE_CHECK(o.top_k >= 1 && o.top_k <= o.experts, kRouter,
              "top_k is {}, but it must be from 1 to the number of experts ({}); hint: top_k "
              "counts the experts each token goes to",
              o.top_k, o.experts);
  WEAVE_CHECK(std::isfinite(o.capacity_factor) && o.capacity_factor >= 0, kRouter,
              "capacity_factor must be 0 (no limit) or positive, found {}", o.capacity_factor);
  WEAVE_CHECK(o.aux_loss_coef >= 0 && o.z_loss_coef >= 0, kRouter,
              "loss coefficients must be 0 or positive, found {} and {}", o.aux_loss_coef,
              o.z_loss_coef);
}

// Which assignments fit their expert's capacity: first choices first, each in token order.
std::vector<char> within_capacity(const std::vector<int64_t>& expert, int64_t tokens, int64_t k,
                                  int64_t experts, int64_t capacity) {
  std::vector<char> kept(expert.size(), 1);
  if (capacity == 0) return kept;
  std::vector<int64_t> taken(size_t(experts), 0);
  for (int64_t j = 0; j < k; ++j)
    for (int64_t t = 0; t < tokens; ++t) {
      const size_t slot = size_t(t * k + j);
      kept[slot] = taken[size_t(expert[slot])]++ < capacity;
    }
  return kept;
}

// Switch's load-balancing loss, experts * sum_e f_e P_e, plus the z-loss, coefficients applied.
Tensor auxiliary_loss(const Tensor& logits, const Tensor& probs, const std::vector<int64_t>& expert,
                      const RouterOptions& o, const ShareReduction& reduce) {
  const TensorOptions like{.dtype = logits.dtype(), .device = logits.device()};
  Tensor loss = zeros({}, like);
  const int64_t tokens = logits.size(0);
  if (tokens == 0) return loss;
  if (o.aux_loss_coef > 0) {
    std::vector<double> share(size_t(o.experts), 0.0);
    for (int64_t e : expert) share[size_t(e)] += 1.0 / double(expert.size());
    if (reduce) share = reduce(share);
    const Tensor f = from_vector(share).to(logits.dtype()).to(logits.device());
    loss = loss + sum(mean(probs, {0}) * f) * (double(o.experts) * o.aux_loss_coef);
  }
  if (o.z_loss_coef > 0) {
    const Tensor shift = max(logits.detach(), {1}, true);
    const Tensor lse = log(sum(exp(logits - shift), {1})) + squeeze(shift, 1);
    loss = loss + mean(lse * lse) * o.z_loss_coef;
  }
  return loss;
}

}  // namespace

TopKRouter::TopKRouter(int64_t hidden, RouterOptions options, Generator* generator)
    : Module("TopKRouter"),
      weight(register_module("gate", (check_router(hidden, options),
                                      std::make_shared<Linear>(hidden, options.experts,
                                                               /*bias=*/false, generator)))
                 ->weight),
      options_(options) {}

Tensor TopKRouter::forward(const Tensor& tokens) {
  return linear(tokens, weight);
}

Routing TopKRouter::route(const Tensor& tokens, const ShareReduction& shares) const {
  WEAVE_CHECK(tokens.dim() == 2 && tokens.size(1) == weight.size(1), kRouter,
              "expected tokens [T, {}], found {}", weight.size(1), tokens.shape());
  const RouterOptions& o = options_;
  const int64_t t = tokens.size(0), k = o.top_k;
  const Tensor logits = linear(tokens, weight);
  Tensor probs, gates;
  if (o.gate == Gate::Softmax) {
    probs = softmax(logits, -1);
    gates = probs;
  } else {
    gates = sigmoid(logits);
    probs = gates / sum(gates, {1}, true);
  }
  const TopK top = topk(gates, k, -1);
  Tensor weights = top.values;
  if (o.gate == Gate::Sigmoid || (o.renormalize && k > 1))
    weights = weights / sum(weights, {1}, true);
  Routing r;
  r.expert = top.indices;
  const std::vector<int64_t> expert = top.indices.to_vector<int64_t>();
  r.capacity = o.capacity_factor > 0
                   ? int64_t(std::ceil(o.capacity_factor * double(t * k) / double(o.experts)))
                   : 0;
  const std::vector<char> kept = within_capacity(expert, t, k, o.experts, r.capacity);
  std::vector<uint8_t> mask(kept.begin(), kept.end());
  r.kept = from_vector(mask).reshape({t, k}).to(kBool).to(tokens.device());
  for (char c : kept) r.dropped += c ? 0 : 1;
  r.weight = r.dropped ? weights * r.kept.to(weights.dtype()) : weights;
  r.aux_loss = auxiliary_loss(logits, probs, expert, o, shares);
  return r;
}

std::shared_ptr<Module> make_expert(int64_t hidden, int64_t ffn, uint64_t seed, int64_t index,
                                    bool gated) {
  Generator g(seed * 1000003 + uint64_t(index) + 1);
  if (gated) return std::make_shared<GatedMLP>(hidden, ffn, GatedMLPOptions{.generator = &g});
  return std::make_shared<Sequential>(std::initializer_list<std::shared_ptr<Module>>{
      std::make_shared<Linear>(hidden, ffn, true, &g), GELU(),
      std::make_shared<Linear>(ffn, hidden, true, &g)});
}

namespace detail {

// The rows an MoE layer sends to its experts: every kept assignment, expert by expert (within
// an expert in token order), so each expert's rows are contiguous.
struct Dispatch {
  std::vector<int64_t> token;        // the token of each dispatched row
  std::vector<int64_t> per_expert;   // rows of each expert
  std::vector<int64_t> row_of_slot;  // slot t * top_k + j -> its dispatched row, or -1 (dropped)
};

Dispatch plan_dispatch(const Routing& routing, int64_t experts) {
  const int64_t k = routing.expert.size(1);
  const std::vector<int64_t> expert = routing.expert.to_vector<int64_t>();
  const std::vector<uint8_t> kept = routing.kept.to(kUInt8).to_vector<uint8_t>();
  std::vector<std::vector<int64_t>> slots(static_cast<size_t>(experts));
  for (size_t slot = 0; slot < expert.size(); ++slot)
    if (kept[slot]) slots[size_t(expert[slot])].push_back(int64_t(slot));
  Dispatch d;
  d.row_of_slot.assign(expert.size(), -1);
  for (const std::vector<int64_t>& list : slots) {
    d.per_expert.push_back(int64_t(list.size()));
    for (int64_t slot : list) {
      d.row_of_slot[size_t(slot)] = int64_t(d.token.size());
      d.token.push_back(slot / k);
    }
  }
  return d;
}

Tensor dispatch_rows(const Tensor& tokens, const Dispatch& dispatch) {
  return index_select(tokens, 0, from_vector(dispatch.token).to(tokens.device()));
}

Tensor combine(const Tensor& rows, const Dispatch& dispatch, const Tensor& weight) {
  const int64_t tokens = weight.size(0), k = weight.size(1), hidden = rows.size(1);
  // A dropped slot's gate is 0 (the router multiplied it by its kept mask, so its gradient is 0
  // too): it may read any row, so it reads row 0 (a zero row when nothing was dispatched).
  const Tensor source = rows.size(0) > 0
                            ? rows
                            : zeros({1, hidden}, {.dtype = rows.dtype(), .device = rows.device()});
  std::vector<int64_t> index = dispatch.row_of_slot;
  for (int64_t& i : index) i = std::max<int64_t>(i, 0);
  const Tensor picked = index_select(source, 0, from_vector(index).to(rows.device()));
  return sum(picked.reshape({tokens, k, hidden}) * unsqueeze(weight.to(rows.dtype()), -1), {1});
}

}  // namespace detail

void check_moe_options(const MoEOptions& options) {
  check_router(options.hidden, options.router);
  WEAVE_CHECK(options.ffn >= 1, "MoE", "ffn must be at least 1, found {}", options.ffn);
  WEAVE_CHECK(options.shared_ffn >= 0 && (options.shared_ffn > 0 || !options.shared_gate), "MoE",
              "shared_ffn must be >= 0 (0: no shared expert), and a shared_gate needs a shared "
              "expert; found shared_ffn {}, shared_gate {}",
              options.shared_ffn, options.shared_gate);
}

Tensor LocalDispatcher::dispatch(const Tensor& rows, const std::vector<int64_t>& per_expert,
                                 const std::function<Tensor(int64_t, const Tensor&)>& run,
                                 MoEStats&) {
  std::vector<Tensor> outputs;
  int64_t offset = 0;
  for (size_t e = 0; e < per_expert.size(); ++e) {
    outputs.push_back(run(int64_t(e), rows.narrow(0, offset, per_expert[e])));
    offset += per_expert[e];
  }
  return cat(outputs);
}

MoE::MoE(MoEOptions options, std::shared_ptr<TokenDispatcher> dispatcher)
    : Module("MoE"),
      options_(std::move(options)),
      dispatcher_(dispatcher ? std::move(dispatcher) : std::make_shared<LocalDispatcher>()) {
  check_moe_options(options_);
  Generator g(options_.seed);
  router_ =
      register_module("router", std::make_shared<TopKRouter>(options_.hidden, options_.router, &g));
  const auto [first, count] = dispatcher_->held_experts(options_.router.experts);
  first_ = first;
  for (int64_t e = first; e < first + count; ++e)
    experts_.push_back(register_module(
        fmt::format("expert{}", e),
        make_expert(options_.hidden, options_.ffn, options_.seed, e, options_.gated)));
  if (options_.shared_ffn > 0) {  // whole on every rank, drawn from the router's generator
    shared =
        register_module("shared", std::make_shared<GatedMLP>(options_.hidden, options_.shared_ffn,
                                                             GatedMLPOptions{.generator = &g}));
    if (options_.shared_gate)
      shared_gate =
          register_module("shared_gate", std::make_shared<Linear>(options_.hidden, 1, false, &g));
  }
}

Module& MoE::expert(int64_t index) {
  WEAVE_CHECK(index >= first_ && index < first_ + local_experts(), "MoE",
              "expert {} is not held on this rank, which holds experts {} to {}", index, first_,
              first_ + local_experts() - 1);
  return *experts_[size_t(index - first_)];
}

Tensor MoE::with_aux_loss(const Tensor& y) const {
  if (!is_training() || !aux_loss_.defined() || !aux_loss_.requires_grad()) return y;
  return attach_loss(y, aux_loss_);
}

Tensor MoE::forward(const Tensor& x) {
  dispatcher_->check_forward();
  const Shape shape = x.shape();
  const Tensor tokens = x.reshape({-1, options_.hidden});
  const Routing routing =
      router_->route(tokens, is_training() ? options_.reduce_shares : ShareReduction());
  aux_loss_ = routing.aux_loss;
  stats_ = {.tokens = tokens.size(0),
            .assignments = tokens.size(0) * options_.router.top_k,
            .dropped = routing.dropped};
  const detail::Dispatch dispatch = detail::plan_dispatch(routing, options_.router.experts);
  // Every held expert runs, on no rows when none were routed to it: its gradient is then zero,
  // not missing, so the step treats every expert alike on every rank (an optimizer decays it,
  // a data-parallel wrapper finds it ready at the same point of backward everywhere).
  const Tensor outputs = dispatcher_->dispatch(
      detail::dispatch_rows(tokens, dispatch), dispatch.per_expert,
      [this](int64_t e, const Tensor& rows) { return (*experts_[size_t(e - first_)])(rows); },
      stats_);
  Tensor routed = detail::combine(outputs, dispatch, routing.weight);
  if (!shared) return routed.reshape(shape);
  Tensor common = (*shared)(tokens);
  if (shared_gate) common = sigmoid((*shared_gate)(tokens)) * common;
  return (routed + common).reshape(shape);
}

}  // namespace weave::nn
