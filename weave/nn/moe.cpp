// Mixture of experts: top-k routing with capacity, the auxiliary losses, and the dispatch and
// combine that every layout of the experts shares.
#include "weave/nn/moe.h"

#include <algorithm>
#include <cmath>
#include <optional>

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
  WEAVE_CHECK(std::isfinite(o.bias_update_rate) && o.bias_update_rate >= 0, kRouter,
              "bias_update_rate must be 0 (no selection bias) or positive, found {}",
              o.bias_update_rate);
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
      options_(options) {
  if (options.bias_update_rate > 0)
    bias_ = &register_buffer("expert_bias", zeros({options.experts}));
}

void TopKRouter::update_bias(const std::vector<double>& load) {
  if (bias_ == nullptr) return;
  WEAVE_CHECK(int64_t(load.size()) == options_.experts, kRouter,
              "expected the loads of {} experts, found {}", options_.experts, load.size());
  double total = 0;
  for (double l : load) total += l;
  const double mean = total / double(load.size());
  std::vector<double> step;
  for (double l : load) {
    // A load within rounding of the mean is balanced: a mean over ranks may round either way.
    const double error = mean - l;
    step.push_back(std::abs(error) <= 1e-9 * mean ? 0.0
                   : error > 0                    ? options_.bias_update_rate
                                                  : -options_.bias_update_rate);
  }
  NoGradGuard no_grad;
  bias_->add_(from_vector(step).to(bias_->dtype()).to(bias_->device()));
}

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
  TopK top;
  if (bias_ != nullptr) {  // chosen by the biased scores, weighted by the unbiased ones
    const Tensor chosen =
        topk(gates.detach() + bias_->to(gates.dtype()).to(gates.device()), k, -1).indices;
    top = {gather(gates, 1, chosen), chosen};
  } else {
    top = topk(gates, k, -1);
  }
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
  std::vector<int64_t> load;         // assignments of each expert, dropped ones too
  std::vector<int64_t> row_of_slot;  // slot t * top_k + j -> its dispatched row, or -1 (dropped)
};

Dispatch plan_dispatch(const Routing& routing, int64_t experts) {
  const int64_t k = routing.expert.size(1);
  const std::vector<int64_t> expert = routing.expert.to_vector<int64_t>();
  const std::vector<uint8_t> kept = routing.kept.to(kUInt8).to_vector<uint8_t>();
  std::vector<std::vector<int64_t>> slots(static_cast<size_t>(experts));
  Dispatch d;
  d.load.assign(size_t(experts), 0);
  for (size_t slot = 0; slot < expert.size(); ++slot) {
    d.load[size_t(expert[slot])] += 1;
    if (kept[slot]) slots[size_t(expert[slot])].push_back(int64_t(slot));
  }
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

// Each token's rows weighted by its gates, in one pass (a dropped slot, row -1, adds nothing).
Tensor combine(const Tensor& rows, const Dispatch& dispatch, const Tensor& weight) {
  const Tensor index = from_vector(dispatch.row_of_slot).reshape(weight.shape()).to(rows.device());
  return gather_weighted_sum(rows, index, weight);
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
                                 const ExpertRun& run, MoEStats&) {
  return run(rows, per_expert);
}

namespace {

// The experts' weights as grouped_linear takes them: the first projection (a gated MLP's
// gate_up, else fc1) and the second (down, else fc2) of every expert, in order.
struct ExpertProjections {
  std::vector<Tensor> first, first_bias, second, second_bias;
  std::optional<GatedActivation> gated;  // else GELU
};

void add_projection(std::vector<Tensor>& weights, std::vector<Tensor>& biases, const Tensor& weight,
                    const Tensor& bias) {
  weights.push_back(weight);
  if (bias.defined()) biases.push_back(bias);
}

// Nothing where some expert must run as its own module: a hook of its own or of a child (a
// wrapper that gathers its parameters around its forward), adapters, another structure.
std::optional<ExpertProjections> projections_of(const std::vector<std::shared_ptr<Module>>& experts,
                                                bool gated) {
  ExpertProjections p;
  const auto plain = [](const Module& m) { return !m.has_forward_hooks(); };
  for (const std::shared_ptr<Module>& expert : experts) {
    if (!plain(*expert)) return std::nullopt;
    if (gated) {
      const auto* mlp = dynamic_cast<const GatedMLP*>(expert.get());
      if (mlp == nullptr || mlp->named_children().size() != 1 || !plain(*mlp->down))
        return std::nullopt;
      p.gated = mlp->activation();
      add_projection(p.first, p.first_bias, mlp->gate_up, mlp->gate_up_bias);
      add_projection(p.second, p.second_bias, mlp->down->weight, mlp->down->bias);
      continue;
    }
    auto* sequence = dynamic_cast<Sequential*>(expert.get());
    if (sequence == nullptr || sequence->size() != 3) return std::nullopt;
    const auto* fc1 = dynamic_cast<const Linear*>(&(*sequence)[0]);
    const auto* fc2 = dynamic_cast<const Linear*>(&(*sequence)[2]);
    if (fc1 == nullptr || fc2 == nullptr || !plain(*fc1) || !plain((*sequence)[1]) || !plain(*fc2))
      return std::nullopt;
    add_projection(p.first, p.first_bias, fc1->weight, fc1->bias);
    add_projection(p.second, p.second_bias, fc2->weight, fc2->bias);
  }
  if (p.first_bias.size() != p.first.size()) p.first_bias.clear();
  if (p.second_bias.size() != p.second.size()) p.second_bias.clear();
  return p;
}

}  // namespace

Tensor MoE::run_experts(const Tensor& rows, const std::vector<int64_t>& counts) {
  const std::optional<ExpertProjections> p =
      options_.grouped ? projections_of(experts_, options_.gated) : std::nullopt;
  if (!p) return run_each(rows, counts);
  const Tensor h = grouped_linear(rows, p->first, counts, p->first_bias);
  return grouped_linear(p->gated ? gated_activation(h, *p->gated) : gelu(h), p->second, counts,
                        p->second_bias);
}

Tensor MoE::run_each(const Tensor& rows, const std::vector<int64_t>& counts) {
  std::vector<Tensor> outputs;
  int64_t offset = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    outputs.push_back((*experts_[e])(rows.narrow(0, offset, counts[e])));
    offset += counts[e];
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
  step_load_.assign(size_t(options_.router.experts), 0);
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
  const detail::Dispatch dispatch = detail::plan_dispatch(routing, options_.router.experts);
  stats_ = {.tokens = tokens.size(0),
            .assignments = tokens.size(0) * options_.router.top_k,
            .dropped = routing.dropped,
            .load = dispatch.load};
  if (is_training() && options_.router.bias_update_rate > 0)
    for (size_t e = 0; e < step_load_.size(); ++e) step_load_[e] += dispatch.load[e];
  // Every held expert runs, on no rows when none were routed to it: its gradient is then zero,
  // not missing, so the step treats every expert alike on every rank (an optimizer decays it,
  // a data-parallel wrapper finds it ready at the same point of backward everywhere).
  const Tensor outputs = dispatcher_->dispatch(
      detail::dispatch_rows(tokens, dispatch), dispatch.per_expert,
      [this](const Tensor& rows, const std::vector<int64_t>& counts) {
        return run_experts(rows, counts);
      },
      stats_);
  Tensor routed = detail::combine(outputs, dispatch, routing.weight);
  if (!shared) return routed.reshape(shape);
  Tensor common = (*shared)(tokens);
  if (shared_gate) common = sigmoid((*shared_gate)(tokens)) * common;
  return (routed + common).reshape(shape);
}

void MoE::update_expert_bias() {
  if (options_.router.bias_update_rate <= 0) return;
  std::vector<double> load(step_load_.begin(), step_load_.end());
  if (options_.reduce_shares) load = options_.reduce_shares(load);
  router_->update_bias(load);
  std::fill(step_load_.begin(), step_load_.end(), 0);
}

void update_expert_biases(Module& model) {
  visit_modules(model, [](Module& module, const std::string&) {
    if (auto* moe = dynamic_cast<MoE*>(&module)) moe->update_expert_bias();
  });
}

std::vector<std::pair<std::string, double>> routing_metrics(const Module& model) {
  std::vector<std::pair<std::string, double>> out;
  visit_modules(const_cast<Module&>(model), [&](Module& module, const std::string& path) {
    const auto* moe = dynamic_cast<const MoE*>(&module);
    if (moe == nullptr || moe->stats().assignments == 0) return;
    const MoEStats& s = moe->stats();
    const double mean = double(s.assignments) / double(s.load.size());
    const std::string name = path.empty() ? "moe" : path;
    out.emplace_back(name + "/max_load",
                     double(*std::max_element(s.load.begin(), s.load.end())) / mean);
    out.emplace_back(name + "/dropped", double(s.dropped) / double(s.assignments));
  });
  return out;
}

}  // namespace weave::nn
