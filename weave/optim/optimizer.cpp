#include "weave/optim/optimizer.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <functional>
#include <unordered_map>

#include "weave/autograd/engine.h"
#include "weave/autograd/grad_mode.h"
#include "weave/kernels/kernels.h"
#include "weave/tensor/tensor_impl.h"
#include "weave/tensor/trace.h"

namespace weave::optim {

namespace {

// The common case, in one fused pass without temporaries: contiguous, one floating dtype.
bool fuses(const Tensor& p, const Tensor& g) {
  return is_floating(p.dtype()) && g.dtype() == p.dtype() && g.device() == p.device() &&
         p.is_contiguous() && g.is_contiguous();
}

// Optimizer state lives in the parameter's compute dtype: float32 for bfloat16/float16, so
// that the moments keep the small values reduced precision would flush or round away.
TensorOptions state_options(const Tensor& p) {
  return {.dtype = compute_dtype(p.dtype()), .device = p.device()};
}

}  // namespace

Optimizer::Optimizer(std::vector<Tensor> params, double lr, double weight_decay)
    : params_(std::move(params)), lr_(lr) {
  WEAVE_CHECK(lr >= 0, "optimizer", "learning rate must be non-negative, found {}", lr);
  std::unordered_map<const TensorImpl*, size_t> seen;
  for (size_t i = 0; i < params_.size(); ++i) {
    WEAVE_CHECK(params_[i].defined() && params_[i].is_leaf() && params_[i].requires_grad(),
                "optimizer", "parameter {} must be a leaf that requires grad", i);
    auto [it, fresh] = seen.emplace(params_[i].impl(), i);
    WEAVE_CHECK(fresh, "optimizer",
                "parameters {} and {} are the same tensor, so it would be updated twice per "
                "step; hint: list each parameter once (a shared weight is one parameter)",
                it->second, i);
  }
  for (const Tensor& p : params_) decay_.push_back({{{0, p.numel()}, weight_decay}});
}

OptimizerState Optimizer::state_dict() const {
  OptimizerState state;
  state.scalars = counters();
  state.scalars["lr"] = lr_;
  state.scalars["params"] = static_cast<double>(params_.size());
  for (auto& [slot, tensors] : const_cast<Optimizer*>(this)->state_slots())
    for (size_t i = 0; i < tensors->size(); ++i)
      if ((*tensors)[i].defined())
        state.tensors.emplace_back(fmt::format("{}.{}", slot, i), (*tensors)[i]);
  return state;
}

void Optimizer::check_state_dict(const OptimizerState& state) const {
  auto slots = const_cast<Optimizer*>(this)->state_slots();
  std::map<std::string, double> expected = counters();
  expected["lr"] = 0;
  expected["params"] = 0;
  for (const auto& [key, value] : expected)
    WEAVE_CHECK(state.scalars.count(key), "load_state_dict", "the optimizer state has no '{}'",
                key);
  for (const auto& [key, value] : state.scalars) {
    WEAVE_CHECK(expected.count(key), "load_state_dict",
                "unexpected '{}' in the optimizer state (another optimizer's?)", key);
    WEAVE_CHECK(std::isfinite(value) && value >= 0, "load_state_dict",
                "optimizer state '{}' is {}, expected a finite non-negative number", key, value);
  }
  WEAVE_CHECK(state.scalars.at("params") == static_cast<double>(params_.size()), "load_state_dict",
              "the optimizer state is for {} parameters, this optimizer has {}",
              state.scalars.at("params"), params_.size());
  for (const auto& entry : state.tensors) {
    const std::string& name = entry.first;  // not a structured binding: the lambda below uses it
    const Tensor& t = entry.second;
    const size_t dot = name.rfind('.');
    auto slot = std::find_if(slots.begin(), slots.end(), [&](const auto& s) {
      return dot != std::string::npos && s.first == name.substr(0, dot);
    });
    WEAVE_CHECK(slot != slots.end(), "load_state_dict",
                "unexpected optimizer state tensor '{}' (another optimizer's?)", name);
    size_t index = 0;
    const std::string digits = name.substr(dot + 1);
    WEAVE_CHECK(!digits.empty() && digits.size() < 10 &&
                    std::all_of(digits.begin(), digits.end(), ::isdigit) &&
                    (index = std::stoul(digits)) < params_.size(),
                "load_state_dict", "optimizer state tensor '{}' names no parameter (there are {})",
                name, params_.size());
    const Tensor& p = params_[index];
    WEAVE_CHECK(t.defined() && t.shape() == p.shape() && t.dtype() == compute_dtype(p.dtype()),
                "load_state_dict",
                "optimizer state tensor '{}' is {} {}, but parameter {} is {} {} (state: {})", name,
                t.defined() ? dtype_name(t.dtype()) : "undefined",
                t.defined() ? t.shape().str() : "", index, dtype_name(p.dtype()), p.shape(),
                dtype_name(compute_dtype(p.dtype())));
  }
}

void Optimizer::load_state_dict(const OptimizerState& state) {
  check_state_dict(state);
  NoGradGuard no_grad;
  for (auto& [slot, tensors] : state_slots()) {
    std::vector<Tensor> loaded(params_.size());
    for (const auto& [name, t] : state.tensors)
      if (name.rfind(slot + ".", 0) == 0 && name.find('.', slot.size() + 1) == std::string::npos) {
        const size_t index = std::stoul(name.substr(slot.size() + 1));
        loaded[index] = t.detach().to(params_[index].device()).contiguous().clone();
      }
    *tensors = std::move(loaded);
  }
  lr_ = state.scalars.at("lr");
  set_counters(state.scalars);
}

void Optimizer::zero_grad(bool set_to_none) {
  optim::zero_grad(params_, set_to_none);
}

void zero_grad(const std::vector<Tensor>& params, bool set_to_none) {
  NoGradGuard no_grad;
  for (const Tensor& p : params) {
    if (!p.grad().defined()) continue;
    if (set_to_none)
      p.set_grad({});
    else
      p.grad().zero_();
  }
}

namespace {
void check_sgd_options(const SGDOptions& options) {
  WEAVE_CHECK(
      !options.nesterov || (options.momentum > 0 && options.dampening == 0), "SGD",
      "Nesterov momentum needs momentum > 0 and dampening 0, found momentum={} dampening={}",
      options.momentum, options.dampening);
}
}  // namespace

SGD::SGD(std::vector<Tensor> params, SGDOptions options)
    : Optimizer(std::move(params), options.lr, options.weight_decay),
      options_(options),
      momentum_(params_.size()) {
  check_sgd_options(options);
}

SGD::SGD(const std::vector<ParamGroup>& groups, SGDOptions options)
    : Optimizer(groups, options.lr), options_(options), momentum_(params_.size()) {
  check_sgd_options(options);
}

void Optimizer::check_backward_complete() const {
  if (autograd::in_backward()) return;  // per-bucket steps inside backward (decentralized)
  const size_t pending = autograd::must_run_pending();
  WEAVE_CHECK(pending == 0, "optimizer step",
              "{} communicating autograd node(s) recorded in forward have not run backward, so "
              "peers may wait for them or gradients they carry are missing; hint: call backward "
              "on every rank (a rank without a loss of its own: autograd::backward({{}})), or "
              "record forward-only communication under NoGradGuard or autograd::ForwardOnlyGuard",
              pending);
}

void SGD::step() {
  const trace::Scope trace_scope("optimizer", "SGD.step");
  check_backward_complete();
  NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    Tensor& p = params_[i];
    if (!p.grad().defined()) continue;
    // Parts that decay differently (a flat shard of two groups) take their decay here.
    const std::optional<double> uniform = uniform_decay(i);
    const double weight_decay = uniform.value_or(0);
    const Tensor g = uniform ? p.grad() : add_part_decay(i, p.grad());
    if (fuses(p, g)) {
      const bool first = options_.momentum != 0 && !momentum_[i].defined();
      if (first) momentum_[i] = empty(p.shape(), state_options(p));
      kernels::sgd_update(p, g, momentum_[i],
                          {.lr = lr_,
                           .momentum = options_.momentum,
                           .dampening = options_.dampening,
                           .weight_decay = weight_decay,
                           .nesterov = options_.nesterov,
                           .first = first});
      p.storage()->bump_version();
      continue;
    }
    Tensor d = g.to(compute_dtype(p.dtype()));
    if (weight_decay != 0) d = d + p * weight_decay;
    if (options_.momentum != 0) {
      Tensor& buf = momentum_[i];
      if (!buf.defined()) {
        buf = d.clone();
      } else {
        buf.mul_(options_.momentum).add_(d, 1 - options_.dampening);
      }
      d = options_.nesterov ? d + buf * options_.momentum : buf;
    }
    p.add_(d, -lr_);
  }
}

std::vector<Tensor> SGD::state() const {
  std::vector<Tensor> out;
  for (const Tensor& t : momentum_)
    if (t.defined()) out.push_back(t);
  return out;
}

std::vector<Tensor> Adam::state() const {
  std::vector<Tensor> out;
  for (size_t i = 0; i < exp_avg_.size(); ++i)
    for (const Tensor& t : {exp_avg_[i], exp_avg_sq_[i]})
      if (t.defined()) out.push_back(t);
  return out;
}

Adam::Adam(std::vector<Tensor> params, AdamOptions options)
    : Adam(std::move(params), options, false) {}

namespace {
void check_adam_options(const AdamOptions& options) {
  WEAVE_CHECK(options.beta1 >= 0 && options.beta1 < 1 && options.beta2 >= 0 && options.beta2 < 1,
              "Adam", "betas must be in [0, 1), found ({}, {})", options.beta1, options.beta2);
  WEAVE_CHECK(options.eps >= 0, "Adam", "eps must be non-negative, found {}", options.eps);
}
}  // namespace

Adam::Adam(std::vector<Tensor> params, AdamOptions options, bool decoupled)
    : Optimizer(std::move(params), options.lr, options.weight_decay),
      options_(options),
      decoupled_(decoupled),
      exp_avg_(params_.size()),
      exp_avg_sq_(params_.size()) {
  check_adam_options(options);
}

Adam::Adam(const std::vector<ParamGroup>& groups, AdamOptions options)
    : Adam(groups, options, false) {}

Adam::Adam(const std::vector<ParamGroup>& groups, AdamOptions options, bool decoupled)
    : Optimizer(groups, options.lr),
      options_(options),
      decoupled_(decoupled),
      exp_avg_(params_.size()),
      exp_avg_sq_(params_.size()) {
  check_adam_options(options);
}

void Adam::step() {
  const trace::Scope trace_scope("optimizer", "Adam.step");
  check_backward_complete();
  NoGradGuard no_grad;
  ++steps_;
  const double correction1 = 1 - std::pow(options_.beta1, static_cast<double>(steps_));
  const double correction2 = 1 - std::pow(options_.beta2, static_cast<double>(steps_));
  std::vector<kernels::AdamTensors> fused;
  for (size_t i = 0; i < params_.size(); ++i) {
    Tensor& p = params_[i];
    if (!p.grad().defined()) continue;
    if (!exp_avg_[i].defined()) {
      exp_avg_[i] = zeros(p.shape(), state_options(p));
      exp_avg_sq_[i] = zeros(p.shape(), state_options(p));
    }
    Tensor g = p.grad();
    // Parts that decay differently (a flat shard of two groups) take their decay here.
    const std::optional<double> uniform = uniform_decay(i);
    const double weight_decay = uniform.value_or(0);
    if (!uniform && decoupled_) decay_parts(i, lr_);
    if (!uniform && !decoupled_) g = add_part_decay(i, g);
    if (fuses(p, g)) {  // updated together below, many parameters per launch
      fused.push_back({p, g, exp_avg_[i], exp_avg_sq_[i], weight_decay});
      continue;
    }
    g = g.to(exp_avg_[i].dtype());
    if (weight_decay != 0) {
      if (decoupled_)
        p.mul_(1 - lr_ * weight_decay);
      else
        g = g + p * weight_decay;
    }
    exp_avg_[i].mul_(options_.beta1).add_(g, 1 - options_.beta1);
    exp_avg_sq_[i].mul_(options_.beta2).add_(g * g, 1 - options_.beta2);
    // p -= lr * m_hat / (sqrt(v_hat) + eps), with m_hat = m / c1 and v_hat = v / c2
    Tensor denom = sqrt(exp_avg_sq_[i] / correction2) + options_.eps;
    p.add_(exp_avg_[i] / denom, -lr_ / correction1);
  }
  const kernels::AdamStep step{.lr = lr_,
                               .beta1 = options_.beta1,
                               .beta2 = options_.beta2,
                               .eps = options_.eps,
                               .weight_decay = 0,
                               .correction1 = correction1,
                               .correction2 = correction2,
                               .decoupled = decoupled_};
  while (!fused.empty()) {  // one call per device
    const Device device = fused.front().param.device();
    std::vector<kernels::AdamTensors> here, rest;
    for (kernels::AdamTensors& t : fused) (t.param.device() == device ? here : rest).push_back(t);
    kernels::adam_update_many(here, step);
    for (const kernels::AdamTensors& t : here) t.param.storage()->bump_version();
    fused = std::move(rest);
  }
}

namespace {
AdamOptions adam_options_of(const AdamWOptions& options) {
  return {.lr = options.lr,
          .beta1 = options.beta1,
          .beta2 = options.beta2,
          .eps = options.eps,
          .weight_decay = options.weight_decay};
}
}  // namespace

AdamW::AdamW(std::vector<Tensor> params, AdamWOptions options)
    : Adam(std::move(params), adam_options_of(options), true) {}

AdamW::AdamW(const std::vector<ParamGroup>& groups, AdamWOptions options)
    : Adam(groups, adam_options_of(options), true) {}

MixedPrecision::MixedPrecision(std::vector<Tensor> params, const Factory& make_optimizer)
    : Optimizer(std::move(params), 0), masters_(params_.size()) {
  NoGradGuard no_grad;
  std::vector<Tensor> stepped;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = params_[i];
    if (compute_dtype(p.dtype()) != p.dtype()) {
      masters_[i] = p.detach().to(compute_dtype(p.dtype())).contiguous().clone();
      masters_[i].requires_grad_();
    }
    stepped.push_back(master(i));
  }
  optimizer_ = make_optimizer(stepped);
  WEAVE_CHECK(
      optimizer_ != nullptr && optimizer_->params().size() == params_.size(), "MixedPrecision",
      "the factory must return an optimizer of the {} masters it is given, found {}",
      params_.size(), optimizer_ ? fmt::format("one of {}", optimizer_->params().size()) : "none");
  lr_ = optimizer_->lr();
}

void MixedPrecision::step() {
  const trace::Scope trace_scope("optimizer", "MixedPrecision.step");
  check_backward_complete();
  NoGradGuard no_grad;
  // The masters' gradients are kept between steps: each step widens into the same buffer.
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!masters_[i].defined()) continue;
    const Tensor& g = params_[i].grad();
    Tensor wide = masters_[i].grad();
    if (!g.defined())
      masters_[i].set_grad({});
    else if (wide.defined())
      wide.copy_(g);
    else
      masters_[i].set_grad(g.to(masters_[i].dtype()));
  }
  optimizer_->set_lr(lr_);
  optimizer_->step();
  for (size_t i = 0; i < params_.size(); ++i)
    if (masters_[i].defined() && params_[i].grad().defined()) params_[i].copy_(masters_[i]);
}

std::vector<Tensor> MixedPrecision::state() const {
  std::vector<Tensor> out;
  for (const Tensor& m : masters_)
    if (m.defined()) out.push_back(m);
  for (const Tensor& t : optimizer_->state()) out.push_back(t);
  return out;
}

std::vector<std::pair<std::string, std::vector<Tensor>*>> MixedPrecision::state_slots() {
  auto slots = optimizer_->state_slots();
  slots.insert(slots.begin(), {"master", &masters_});
  return slots;
}

void MixedPrecision::set_counters(const std::map<std::string, double>& counters) {
  optimizer_->set_counters(counters);
  // The masters were replaced by loaded copies (undefined where the state had none): each
  // becomes a leaf again (rebuilt from its parameter if missing), its parameter takes the
  // rounded value, and the wrapped optimizer steps the new masters.
  NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    Tensor& p = params_[i];
    if (compute_dtype(p.dtype()) != p.dtype()) {
      if (!masters_[i].defined()) masters_[i] = p.detach().to(compute_dtype(p.dtype())).clone();
      masters_[i].requires_grad_();
      p.copy_(masters_[i]);
    } else {
      masters_[i] = Tensor();
    }
    optimizer_->params_[i] = master(i);
  }
}

namespace detail {

double grad_norm_partial(const std::vector<Tensor>& params, double norm_type, const char* op) {
  std::vector<Tensor> grads;
  for (const Tensor& p : params) grads.push_back(p.grad());
  return norm_partial(grads, norm_type, op);
}

namespace {
/// The defined, non-empty tensors of `tensors`, grouped by device in order of first appearance.
std::vector<std::pair<Device, std::vector<Tensor>>> by_device(const std::vector<Tensor>& tensors) {
  std::vector<std::pair<Device, std::vector<Tensor>>> groups;
  for (const Tensor& t : tensors) {
    if (!t.defined() || t.numel() == 0) continue;
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const auto& group) { return group.first == t.device(); });
    if (it == groups.end()) it = groups.insert(groups.end(), {t.device(), {}});
    it->second.push_back(t);
  }
  return groups;
}
}  // namespace

double norm_partial(const std::vector<Tensor>& grads, double norm_type, const char* op) {
  NoGradGuard no_grad;
  WEAVE_CHECK(norm_type >= 1, op, "norm_type must be >= 1, found {}", norm_type);
  // One fused pass per device, read once: a read per parameter would stall the host on each
  // one (a GPU step would wait for every gradient in turn).
  const bool largest = std::isinf(norm_type);
  double total = 0;
  for (auto& [device, list] : by_device(grads)) {
    for (Tensor& grad : list) grad = grad.contiguous();
    Tensor part = empty({}, {.dtype = kFloat64, .device = device});
    kernels::norm_power_sum(list, norm_type, part);
    const double value = part.item<double>();
    total = !largest                                   ? total + value
            : (std::isnan(total) || std::isnan(value)) ? NAN
                                                       : std::max(total, value);
  }
  return total;
}

void check_max_norm(double max_norm, const char* op) {
  WEAVE_CHECK(max_norm >= 0, op,
              "max_norm must be a number >= 0, found {}; hint: a negative max_norm would flip "
              "the gradients' sign, INFINITY measures the norm without clipping",
              max_norm);
}

void check_finite_norm(double total_norm, bool error_if_nonfinite, const char* op) {
  WEAVE_CHECK(!error_if_nonfinite || std::isfinite(total_norm), op,
              "the total norm of the gradients is {}: some gradient holds NaN or infinity; the "
              "gradients were left unchanged; hint: skip this step (zero_grad), lower the "
              "learning rate or the loss scale",
              total_norm);
}

void scale_grads_to(const std::vector<Tensor>& params, double max_norm, double total_norm) {
  NoGradGuard no_grad;
  const double scale = max_norm / (total_norm + 1e-6);
  if (scale >= 1) return;  // NaN goes on: as in PyTorch, a NaN norm makes every gradient NaN
  std::vector<Tensor> contiguous;
  for (const Tensor& p : params) {
    Tensor g = p.grad();
    if (g.defined() && g.is_contiguous())
      contiguous.push_back(g);
    else if (g.defined())
      g.mul_(scale);
  }
  for (const auto& [device, grads] : by_device(contiguous)) {
    kernels::scale_many(grads, scale);
    for (const Tensor& g : grads) g.storage()->bump_version();
  }
}

}  // namespace detail

double clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type,
                       bool error_if_nonfinite) {
  const char* op = "clip_grad_norm_";
  detail::check_max_norm(max_norm, op);
  for (size_t i = 0; i < params.size(); ++i) {
    const AutogradMeta* meta = params[i].defined() ? params[i].impl()->autograd.get() : nullptr;
    const PlacementRecord* placement = meta ? meta->placement.get() : nullptr;
    WEAVE_CHECK(placement == nullptr || !placement->spread(), op,
                "parameter {} ({} {}) is this rank's part of a parameter spread over several "
                "ranks ({}); clipping it by this rank's norm alone would scale each rank's part "
                "differently, by a norm that is not the model's",
                i, params[i].dtype(), params[i].shape(), placement ? placement->describe() : "");
  }
  double total = detail::grad_norm_partial(params, norm_type, op);
  if (!std::isinf(norm_type)) total = std::pow(total, 1.0 / norm_type);
  detail::check_finite_norm(total, error_if_nonfinite, op);
  detail::scale_grads_to(params, max_norm, total);
  return total;
}

}  // namespace weave::optim
