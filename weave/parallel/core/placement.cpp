// Placements: the cuts recorded on a parameter, and the clipping that reads them.
#include "weave/parallel/core/placement.h"

#include <cmath>
#include <map>

#include "weave/optim/optimizer.h"
#include "weave/parallel/core/agree.h"
#include "weave/parallel/core/layout.h"

namespace weave::parallel {

std::string Cut::str() const {
  switch (kind) {
    case Kind::Split:
      return fmt::format("split along axis {} over group {}", axis, group.str());
    case Kind::FlatShard:
      return fmt::format("a flat shard over group {}", group.str());
    case Kind::Experts:
      return fmt::format("experts {}..{} of {} over group {}", first, first + count - 1, total,
                         group.str());
    case Kind::Stage:
      return fmt::format("a pipeline stage's over group {}", group.str());
  }
  return "an unknown cut";
}

bool Placement::spread() const {
  for (const Cut& cut : cuts)
    if (cut.group.size() > 1) return true;
  return false;
}

std::string Placement::str() const {
  std::string out;
  for (const Cut& cut : cuts) out += (out.empty() ? "" : "; ") + cut.str();
  return out.empty() ? "replicated" : out;
}

std::string Placement::describe() const {
  return str() + "; hint: " +
         (hint.empty() ? "clip with parallel::clip_grad_norm_(params, max_norm), which reads "
                         "each parameter's placement"
                       : hint);
}

int Placement::copies_in(const dist::Group& group) const {
  int64_t pieces = 1;
  for (const Cut& cut : cuts) pieces *= cut.group.size();
  WEAVE_CHECK(pieces >= 1 && group.size() % pieces == 0, "clip_grad_norm_",
              "a parameter is cut into {} pieces ({}), which do not divide the {} ranks of group "
              "{}; hint: clip over the group whose ranks together hold the whole model",
              pieces, str(), group.size(), group.str());
  return static_cast<int>(group.size() / pieces);
}

const Placement* placement_of(const Tensor& t) {
  if (!t.defined() || !t.impl()->autograd) return nullptr;
  return dynamic_cast<const Placement*>(t.impl()->autograd->placement.get());
}

void add_cut(const Tensor& t, Cut cut, const std::string& hint) {
  WEAVE_CHECK(t.defined(), "add_cut", "expected a tensor, found an undefined one");
  auto placement = std::make_shared<Placement>();
  if (const Placement* before = placement_of(t)) *placement = *before;
  // One cut of each kind: a pipeline rebuilt over other ranks moves its stage, say.
  std::erase_if(placement->cuts, [&](const Cut& c) { return c.kind == cut.kind; });
  placement->cuts.push_back(std::move(cut));
  if (!hint.empty()) placement->hint = hint;
  t.impl()->meta().placement = std::move(placement);
}

namespace {

// The sum of |g|^p (max |g| for p = INFINITY) over the distinct pieces of the model this rank
// holds, each weighted by 1 / its copies in the group, so the group's sum counts it once.
double weighted_partial(const std::vector<Tensor>& params, double norm_type,
                        const dist::Group& group, const char* op) {
  std::map<int, std::vector<Tensor>> by_copies;
  for (const Tensor& p : params) {
    if (!p.defined()) continue;
    const Placement* placement = placement_of(p);
    if (placement != nullptr)
      if (const auto layout = detail::flat_shard_of(p))
        for (const TensorSplit& split : layout->splits)
          WEAVE_CHECK(split.count == 1, op,
                      "a flat shard ({}) holds tensor-parallel slices, whose copies differ from "
                      "the shard's; clipping such a mix is not supported yet; hint: clip the "
                      "FSDP model with fsdp.clip_grad_norm_",
                      placement->str());
    by_copies[placement ? placement->copies_in(group) : group.size()].push_back(p);
  }
  const bool inf = std::isinf(norm_type);
  double total = 0;
  for (const auto& [copies, members] : by_copies) {
    const double part = optim::detail::grad_norm_partial(members, norm_type, op);
    total = inf ? (std::isnan(part) ? part : std::max(total, part)) : total + part / copies;
  }
  return total;
}

}  // namespace

double clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type,
                       const dist::Group& group, bool error_if_nonfinite) {
  const char* op = "clip_grad_norm_";
  const bool inf = std::isinf(norm_type);
  // A rank whose arguments are bad says so in the same all_reduce, so every rank raises instead
  // of the others scaling alone.
  std::exception_ptr my_error;
  double partial = 0;
  try {
    optim::detail::check_max_norm(max_norm, op);
    partial = weighted_partial(params, norm_type, group, op);
  } catch (const Error&) {
    my_error = std::current_exception();
  }
  Tensor reduced = from_vector<double>({partial, my_error ? 1.0 : 0.0});
  dist::all_reduce(reduced, inf ? dist::ReduceOp::Max : dist::ReduceOp::Sum, group);
  if (my_error) std::rethrow_exception(my_error);
  const std::vector<double> values = reduced.to_vector<double>();
  WEAVE_CHECK(values[1] == 0, op, "another rank of group {} rejected its arguments; see its error",
              group.str());
  const double total = inf ? values[0] : std::pow(values[0], 1.0 / norm_type);
  optim::detail::check_finite_norm(total, error_if_nonfinite, op);
  optim::detail::scale_grads_to(params, max_norm, total);
  return total;
}

namespace detail {

void refuse_spread_experts(const nn::Module& module, const dist::Group& group, const char* op) {
  check_together(
      [&] {
        for (const auto& [name, p] : module.named_parameters()) {
          const Placement* placement = placement_of(p);
          if (placement == nullptr) continue;
          for (const Cut& cut : placement->cuts)
            WEAVE_CHECK(cut.kind != Cut::Kind::Experts || cut.group.size() == 1, op,
                        "parameter '{}' is one of {}: its gradient already sums the batches of "
                        "that expert group, and averaging it over group {} leaves out the "
                        "group's scale 1/{}, so training would be silently off; hint: wrap the "
                        "dense part only, and average the experts' gradients over "
                        "mesh.group({{Axis::ExpertData}}) times 1/{} until the wrappers read "
                        "placements",
                        name, cut.str(), group.str(), cut.group.size(), cut.group.size());
        }
      },
      group, op);
}

}  // namespace detail

}  // namespace weave::parallel
