// Parameter groups: each element of a parameter with its group's weight decay (optimizer.h).
#include <algorithm>
#include <cmath>
#include <functional>
#include <unordered_map>

#include "weave/optim/optimizer.h"
#include "weave/tensor/tensor_impl.h"

namespace weave::optim {

namespace {

// The groups' parameters, each once (a flat shard may appear in several groups, in parts).
std::vector<Tensor> params_of(const std::vector<ParamGroup>& groups) {
  std::vector<Tensor> out;
  std::unordered_map<const TensorImpl*, size_t> seen;
  for (const ParamGroup& g : groups)
    for (const Tensor& p : g.params)
      if (!p.defined() || seen.emplace(p.impl(), out.size()).second) out.push_back(p);
  return out;
}

}  // namespace

Optimizer::Optimizer(const std::vector<ParamGroup>& groups, double lr)
    : Optimizer(params_of(groups), lr) {
  const char* op = "optimizer";
  std::unordered_map<const TensorImpl*, size_t> index;
  for (size_t i = 0; i < params_.size(); ++i) index.emplace(params_[i].impl(), i);
  for (auto& parts : decay_) parts.clear();
  for (size_t g = 0; g < groups.size(); ++g) {
    const ParamGroup& group = groups[g];
    WEAVE_CHECK(group.ranges.empty() || group.ranges.size() == group.params.size(), op,
                "group {} lists {} ranges for {} parameters; hint: one range per parameter, or "
                "none (whole parameters)",
                g, group.ranges.size(), group.params.size());
    WEAVE_CHECK(std::isfinite(group.weight_decay) && group.weight_decay >= 0, op,
                "group {}'s weight_decay must be a finite number >= 0, found {}", g,
                group.weight_decay);
    for (size_t k = 0; k < group.params.size(); ++k) {
      const Tensor& p = group.params[k];
      const ElementRange range =
          group.ranges.empty() ? ElementRange{0, p.numel()} : group.ranges[k];
      WEAVE_CHECK(range.begin >= 0 && range.begin <= range.end && range.end <= p.numel(), op,
                  "group {} gives parameter {} (of {} elements) the range [{}, {})", g, k,
                  p.numel(), range.begin, range.end);
      WEAVE_CHECK(group.ranges.empty() || p.is_contiguous(), op,
                  "group {} gives a range of a non-contiguous parameter {}", g, k);
      decay_[index.at(p.impl())].push_back({range, group.weight_decay});
    }
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& parts = decay_[i];
    std::sort(parts.begin(), parts.end(),
              [](const DecayPart& a, const DecayPart& b) { return a.range.begin < b.range.begin; });
    for (size_t k = 1; k < parts.size(); ++k)
      WEAVE_CHECK(parts[k - 1].range.end <= parts[k].range.begin, op,
                  "parameter {} ({}) is in two groups (elements [{}, {}) and [{}, {})); hint: each "
                  "parameter belongs to one group",
                  i, params_[i].shape(), parts[k - 1].range.begin, parts[k - 1].range.end,
                  parts[k].range.begin, parts[k].range.end);
  }
}

std::optional<double> Optimizer::uniform_decay(size_t i) const {
  const auto& parts = decay_[i];
  const bool no_decay = std::all_of(parts.begin(), parts.end(),
                                    [](const DecayPart& part) { return part.weight_decay == 0; });
  if (no_decay) return 0.0;
  if (parts.size() == 1 && parts[0].range.begin == 0 && parts[0].range.end == params_[i].numel())
    return parts[0].weight_decay;
  return std::nullopt;
}

Tensor Optimizer::add_part_decay(size_t i, const Tensor& grad) const {
  Tensor out = grad.contiguous().clone();
  const Tensor flat = out.view({-1}), values = params_[i].detach().view({-1});
  for (const DecayPart& part : decay_[i]) {
    const int64_t n = part.range.end - part.range.begin;
    if (part.weight_decay != 0 && n > 0)
      flat.narrow(0, part.range.begin, n)
          .add_(values.narrow(0, part.range.begin, n), part.weight_decay);
  }
  return out;
}

std::vector<Optimizer::DecaySegment> Optimizer::decay_segments(size_t i) const {
  std::vector<DecaySegment> out;
  int64_t at = 0;
  for (const DecayPart& part : decay_[i]) {
    if (part.range.begin > at) out.push_back({at, part.range.begin, 0.0});
    if (part.range.end > part.range.begin)
      out.push_back({part.range.begin, part.range.end, part.weight_decay});
    at = std::max(at, part.range.end);
  }
  if (at < params_[i].numel()) out.push_back({at, params_[i].numel(), 0.0});
  return out;
}

void Optimizer::decay_parts(size_t i, double lr) const {
  const Tensor flat = params_[i].detach().view({-1});
  for (const DecayPart& part : decay_[i]) {
    const int64_t n = part.range.end - part.range.begin;
    if (part.weight_decay != 0 && n > 0)
      flat.narrow(0, part.range.begin, n).mul_(1 - lr * part.weight_decay);
  }
}

std::vector<ParamGroup> weight_decay_groups(const nn::Module& model, double weight_decay) {
  ParamGroup decay{.params = {}, .weight_decay = weight_decay}, none{.params = {}};
  std::unordered_map<const TensorImpl*, bool> seen;
  nn::visit_modules(const_cast<nn::Module&>(model), [&](const nn::Module& m, const std::string&) {
    const std::string& kind = m.name();
    const bool exempt = kind.find("Norm") != std::string::npos ||
                        (kind.size() >= 9 && kind.compare(kind.size() - 9, 9, "Embedding") == 0);
    for (const auto& [name, p] : m.named_parameters(/*recurse=*/false)) {
      if (!p.defined() || !p.requires_grad() || !seen.emplace(p.impl(), true).second) continue;
      (exempt || p.dim() < 2 ? none : decay).params.push_back(p);
    }
  });
  std::vector<ParamGroup> out;
  for (ParamGroup* g : {&decay, &none})
    if (!g->params.empty()) out.push_back(std::move(*g));
  return out;
}

}  // namespace weave::optim
