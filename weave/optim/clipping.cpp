// Gradient clipping: the norm of many gradients in one pass per device, read on the host or
// kept on the device (for captured steps), and the scaling that follows.
#include <algorithm>
#include <cmath>

#include "weave/autograd/grad_mode.h"
#include "weave/kernels/kernels.h"
#include "weave/optim/optimizer.h"
#include "weave/tensor/tensor_impl.h"

namespace weave::optim {

namespace detail {

double grad_norm_partial(const std::vector<Tensor>& params, double norm_type, const char* op) {
  std::vector<Tensor> grads;
  for (const Tensor& p : params) grads.push_back(p.grad());
  return norm_partial(grads, norm_type, op);
}

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

void check_not_spread(const std::vector<Tensor>& params, const char* op) {
  for (size_t i = 0; i < params.size(); ++i) {
    const AutogradMeta* meta = params[i].defined() ? params[i].impl()->autograd.get() : nullptr;
    const PlacementRecord* placement = meta ? meta->placement.get() : nullptr;
    WEAVE_CHECK(placement == nullptr || !placement->spread(), op,
                "parameter {} ({} {}) is this rank's part of a parameter spread over several "
                "ranks ({}); clipping it by this rank's norm alone would scale each rank's part "
                "differently, by a norm that is not the model's",
                i, params[i].dtype(), params[i].shape(), placement ? placement->describe() : "");
  }
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
  detail::check_not_spread(params, op);
  double total = detail::grad_norm_partial(params, norm_type, op);
  if (!std::isinf(norm_type)) total = std::pow(total, 1.0 / norm_type);
  detail::check_finite_norm(total, error_if_nonfinite, op);
  detail::scale_grads_to(params, max_norm, total);
  return total;
}

Tensor clip_grad_norm_on_device_(const std::vector<Tensor>& params, double max_norm,
                                 double norm_type) {
  const char* op = "clip_grad_norm_on_device_";
  NoGradGuard no_grad;
  detail::check_max_norm(max_norm, op);
  WEAVE_CHECK(norm_type >= 1, op, "norm_type must be >= 1, found {}", norm_type);
  detail::check_not_spread(params, op);
  std::vector<Tensor> contiguous, strided, all;
  Device device = params.empty() ? kCPU : params.front().device();
  for (const Tensor& p : params) {
    const Tensor& g = p.grad();
    if (!g.defined() || g.numel() == 0) continue;
    WEAVE_CHECK(g.device() == device, op,
                "the gradients are on {} and {}: the norm is kept on one device; hint: "
                "clip_grad_norm_ reads the norm on the host, across devices",
                device, g.device());
    (g.is_contiguous() ? contiguous : strided).push_back(g);
    all.push_back(g.is_contiguous() ? g : g.contiguous());
  }
  Tensor power_sum = empty({}, {.dtype = kFloat64, .device = device});
  kernels::norm_power_sum(all, norm_type, power_sum);
  Tensor norm = empty({2}, {.dtype = kFloat64, .device = device});  // {total, coefficient}
  kernels::clip_many(contiguous, power_sum, norm_type, max_norm, norm);
  for (const Tensor& g : contiguous) g.storage()->bump_version();
  for (Tensor& g : strided) g.mul_(norm.narrow(0, 1, 1).reshape({}));
  return norm.select(0, 0);
}

}  // namespace weave::optim
