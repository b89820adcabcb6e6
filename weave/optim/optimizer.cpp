#include "weave/optim/optimizer.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <functional>
#include <unordered_map>

#include "weave/autograd/engine.h"
#include "weave/autograd/grad_mode.h"
#include "weave/kernels/kernels.h"
#include "weave/optim/internal.h"
#include "weave/tensor/tensor_impl.h"
#include "weave/tensor/trace.h"

namespace weave::optim {

using detail::fuses;
using detail::state_options;

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
  for (size_t i = 0; i < params_.size(); ++i) {
    const AutogradMeta* meta = params_[i].impl()->autograd.get();
    WEAVE_CHECK(meta == nullptr || meta->managed_by.empty(), "optimizer step",
                "parameter {} ({} {}) is managed by {}; stepping it would train nothing", i,
                params_[i].dtype(), params_[i].shape(), meta->managed_by);
  }
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
    // Parts that decay differently (a flat shard of two groups) take their decay here: in the
    // fused kernel segment by segment, as whole parameters would (decay_segments).
    const std::optional<double> uniform = uniform_decay(i);
    const double weight_decay = uniform.value_or(0);
    const bool segments = !uniform && fuses(p, p.grad());
    const Tensor g = uniform || segments ? p.grad() : add_part_decay(i, p.grad());
    if (fuses(p, g)) {
      const bool first = options_.momentum != 0 && !momentum_[i].defined();
      if (first) momentum_[i] = empty(p.shape(), state_options(p));
      const kernels::SgdStep step{.lr = lr_,
                                  .momentum = options_.momentum,
                                  .dampening = options_.dampening,
                                  .weight_decay = weight_decay,
                                  .nesterov = options_.nesterov,
                                  .first = first};
      if (!segments) kernels::sgd_update(p, g, momentum_[i], step);
      for (const DecaySegment& part : segments ? decay_segments(i) : std::vector<DecaySegment>{}) {
        kernels::SgdStep mine = step;
        mine.weight_decay = part.weight_decay;
        auto piece = [&](const Tensor& t) {
          return t.defined() ? t.view({-1}).narrow(0, part.begin, part.end - part.begin) : t;
        };
        kernels::sgd_update(piece(p), piece(g), piece(momentum_[i]), mine);
      }
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

void MixedPrecision::set_lr(double lr) {
  Optimizer::set_lr(lr);
  optimizer_->set_lr(lr);  // a capturable one writes it on its device now, not at the step
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

}  // namespace weave::optim
