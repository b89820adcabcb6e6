// Placements: the cuts recorded on a parameter, and the clipping that reads them.
#include "weave/parallel/core/placement.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <span>
#include <string>

#include "weave/distributed/exact_sum.h"
#include "weave/optim/optimizer.h"
#include "weave/parallel/core/agree.h"

namespace weave::parallel {

std::string Cut::str() const {
  switch (kind) {
    case Kind::Split:
      return fmt::format("split along axis {} over group {}{}{}", axis, group.str(),
                         size < 0 ? "" : fmt::format(", padded past {}", size),
                         across_batches ? ", across batches" : "");
    case Kind::FlatShard:
      return fmt::format("a flat shard over group {}", group.str());
    case Kind::Experts:
      return fmt::format("experts {}..{} of {} over group {}", first, first + count - 1, total,
                         group.str());
    case Kind::Stage:
      return count > 1
                 ? fmt::format("the first and the last pipeline stage's over group {}", group.str())
                 : fmt::format("a pipeline stage's over group {}", group.str());
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
  if (out.empty()) out = "replicated";
  if (context) out += fmt::format("; read in parts of each sequence over group {}", context->str());
  return out;
}

std::string Placement::describe() const {
  return str() + "; hint: " +
         (hint.empty() ? "clip with parallel::clip_grad_norm_(params, max_norm), which reads "
                         "each parameter's placement"
                       : hint);
}

int Placement::copies_in(const dist::Group& group) const {
  int64_t pieces = 1, tied = 1;
  for (const Cut& cut : cuts) {
    pieces *= cut.group.size();
    if (cut.kind == Cut::Kind::Stage && cut.count > 1) tied = cut.count;
  }
  WEAVE_CHECK(pieces >= 1 && group.size() % pieces == 0, "clip_grad_norm_",
              "a parameter is cut into {} pieces ({}), which do not divide the {} ranks of group "
              "{}; hint: clip over the group whose ranks together hold the whole model",
              pieces, str(), group.size(), group.str());
  return static_cast<int>(group.size() / pieces * tied);
}

void record_context_reads(const nn::Module& module, const dist::Group& context) {
  if (context.size() <= 1) return;
  for (const Tensor& p : module.parameters()) {
    auto placement = std::make_shared<Placement>();
    if (const Placement* before = placement_of(p)) *placement = *before;
    placement->context = context;
    p.impl()->meta().placement = std::move(placement);
  }
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

void mark_reproducible(const Tensor& t) {
  auto placement = std::make_shared<Placement>();
  if (const Placement* before = placement_of(t)) *placement = *before;
  placement->reproducible = true;
  t.impl()->meta().placement = std::move(placement);
}

void tie_first_and_last_stage(const Tensor& parameter) {
  WEAVE_CHECK(parameter.defined(), "tie_first_and_last_stage",
              "expected a parameter, found an undefined tensor");
  // The pipeline's group is not known yet: the Pipeline records the Stage cut with it.
  auto placement = std::make_shared<Placement>();
  if (const Placement* before = placement_of(parameter)) *placement = *before;
  placement->tied_across_stages = true;
  parameter.impl()->meta().placement = std::move(placement);
}

std::map<std::string, int> split_axes(const nn::Module& module) {
  std::map<std::string, int> out;
  for (const auto& [name, split] : detail::split_parameters(module)) out[name] = split.axis;
  return out;
}

std::map<std::string, TensorSplit> tensor_splits(const nn::Module& module) {
  std::map<std::string, TensorSplit> out;
  for (const auto& [name, split] : detail::split_parameters(module))
    out[name] = {split.axis, split.group.rank(), split.group.size(), split.size};
  return out;
}

namespace detail {

std::map<std::string, Cut> split_parameters(const nn::Module& module) {
  std::map<std::string, Cut> out;
  for (const auto& [name, p] : module.named_parameters())
    if (const Placement* placement = placement_of(p))
      for (const Cut& cut : placement->cuts)
        if (cut.kind == Cut::Kind::Split) out.emplace(name, cut);
  return out;
}

std::shared_ptr<const FlatShard> flat_shard_of(const Tensor& t) {
  if (const Placement* placement = placement_of(t))
    for (const Cut& cut : placement->cuts)
      if (cut.kind == Cut::Kind::FlatShard) return cut.layout;
  return nullptr;
}

void remove_cut(const Tensor& t, Cut::Kind kind) {
  const Placement* before = placement_of(t);
  if (before == nullptr) return;
  auto placement = std::make_shared<Placement>(*before);
  std::erase_if(placement->cuts, [&](const Cut& c) { return c.kind == kind; });
  t.impl()->meta().placement = std::move(placement);
}

}  // namespace detail

namespace {

// Adds the gradient of a flat shard over `group` to `by_copies`, member by member: a member that
// is a tensor-parallel slice has fewer copies than the shard (FSDP around tensor parallelism).
void add_flat_shard(const Tensor& shard, const Placement& placement,
                    const detail::FlatShard& layout, const dist::Group& group,
                    std::map<int, std::vector<Tensor>>& by_copies) {
  const int copies = placement.copies_in(group);
  const Tensor grad = shard.grad();
  if (!grad.defined()) return;
  if (std::all_of(layout.splits.begin(), layout.splits.end(),
                  [](const TensorSplit& split) { return split.count == 1; }))
    return by_copies[copies].push_back(grad);  // one partial norm for the whole shard
  const int64_t end = layout.begin + grad.numel();
  for (size_t k = 0; k < layout.offsets.size(); ++k) {
    const int64_t lo = std::max(layout.begin, layout.offsets[k]);
    const int64_t hi = std::min(end, layout.offsets[k] + layout.shapes[k].numel());
    if (lo >= hi) continue;
    const int count = k < layout.splits.size() ? layout.splits[k].count : 1;
    WEAVE_CHECK(copies % count == 0, "clip_grad_norm_",
                "a flat shard ({}) holds a member split {} ways, which does not divide its {} "
                "copies in group {}: the norm over that group misses the other slices; hint: "
                "parallel::clip_grad_norm_(fsdp.parameters(), max_norm) takes the whole model's "
                "norm over every rank (the world), splits included",
                placement.str(), count, copies, group.str());
    by_copies[copies / count].push_back(grad.reshape({-1}).narrow(0, lo - layout.begin, hi - lo));
  }
}

// This rank's gradients by how many ranks of `group` hold the same piece.
std::map<int, std::vector<Tensor>> grads_by_copies(const std::vector<Tensor>& params,
                                                   const dist::Group& group) {
  std::map<int, std::vector<Tensor>> by_copies;  // copies -> gradients
  for (const Tensor& p : params) {
    if (!p.defined()) continue;
    const Placement* placement = placement_of(p);
    if (placement == nullptr) {
      by_copies[group.size()].push_back(p.grad());
    } else if (const auto layout = detail::flat_shard_of(p)) {
      add_flat_shard(p, *placement, *layout, group, by_copies);
    } else {
      by_copies[placement->copies_in(group)].push_back(p.grad());
    }
  }
  return by_copies;
}

// The sum of |g|^p (max |g| for p = INFINITY) over the distinct pieces of the model this rank
// holds, each weighted by 1 / its copies in the group, so the group's sum counts it once.
double weighted_partial(const std::map<int, std::vector<Tensor>>& by_copies, double norm_type,
                        const char* op) {
  const bool inf = std::isinf(norm_type);
  double total = 0;
  for (const auto& [copies, grads] : by_copies) {
    const double part = optim::detail::norm_partial(grads, norm_type, op);
    total = inf ? (std::isnan(part) ? part : std::max(total, part)) : total + part / copies;
  }
  return total;
}

// The same sum exactly, every piece counted 2 x group.size() times (each class of copies
// multiplied up to it, in integers), so that the group's sum divides exactly by that count.
dist::ExactSum exact_partial(const std::map<int, std::vector<Tensor>>& by_copies, double norm_type,
                             const dist::Group& group, const char* op) {
  WEAVE_CHECK(norm_type >= 1, op, "norm_type must be >= 1, found {}", norm_type);
  const int64_t common = 2 * int64_t(group.size());
  dist::ExactSum total;
  for (const auto& [copies, grads] : by_copies) {
    WEAVE_CHECK(common % copies == 0, op,
                "a piece held {} times does not divide into twice the {} ranks of group {}", copies,
                group.size(), group.str());
    dist::ExactSum part;
    part.add_power_sum(grads, norm_type);
    total += part.multiplied(common / copies);
  }
  return total;
}

// The norm over `group`: one all_reduce, whose last word counts the ranks that rejected their
// arguments (each rethrows its own error; the others raise naming the group).
double reduced_norm(const std::vector<Tensor>& params, double max_norm, double norm_type,
                    const dist::Group& group, const char* op) {
  const bool inf = std::isinf(norm_type);
  const bool exact = !inf && std::any_of(params.begin(), params.end(), [](const Tensor& p) {
    const Placement* placement = p.defined() ? placement_of(p) : nullptr;
    return placement != nullptr && placement->reproducible;
  });
  std::exception_ptr my_error;
  double partial = 0;
  dist::ExactSum exact_sum;
  try {
    optim::detail::check_max_norm(max_norm, op);
    const auto by_copies = grads_by_copies(params, group);
    if (exact)
      exact_sum = exact_partial(by_copies, norm_type, group, op);
    else
      partial = weighted_partial(by_copies, norm_type, op);
  } catch (const Error&) {
    my_error = std::current_exception();
  }
  double total = 0, rejected = 0;
  if (exact) {
    int64_t flag = my_error ? 1 : 0;
    exact_sum.all_reduce(group, std::span<int64_t>(&flag, 1));
    rejected = double(flag);
    total = std::pow(exact_sum.divided(2 * int64_t(group.size())).value(), 1.0 / norm_type);
  } else {
    Tensor reduced = from_vector<double>({partial, my_error ? 1.0 : 0.0});
    dist::all_reduce(reduced, inf ? dist::ReduceOp::Max : dist::ReduceOp::Sum, group);
    const std::vector<double> values = reduced.to_vector<double>();
    rejected = values[1];
    total = inf ? values[0] : std::pow(values[0], 1.0 / norm_type);
  }
  if (my_error) std::rethrow_exception(my_error);
  WEAVE_CHECK(rejected == 0, op, "another rank of group {} rejected its arguments; see its error",
              group.str());
  return total;
}

}  // namespace

double clip_grad_norm_(const std::vector<Tensor>& params, double max_norm, double norm_type,
                       const dist::Group& group, bool error_if_nonfinite) {
  const char* op = "clip_grad_norm_";
  const double total = reduced_norm(params, max_norm, norm_type, group, op);
  optim::detail::check_finite_norm(total, error_if_nonfinite, op);
  optim::detail::scale_grads_to(params, max_norm, total);
  return total;
}

namespace detail {

double ReplicaGroups::scale(int k) const {
  return double(groups[size_t(k)].size()) / double(groups[0].size());
}

std::vector<Tensor> ReplicaGroups::members(const std::vector<Tensor>& params, int k) const {
  std::vector<Tensor> out;
  for (size_t i = 0; i < params.size(); ++i)
    if (of[i] == k) out.push_back(params[i]);
  return out;
}

namespace {

// A vocabulary piece's key in piece_inside: below -1, apart from the experts' first indices.
constexpr int64_t vocabulary_key(int piece) {
  return -2 - piece;
}

// Which piece this rank holds of parameter `p` where its copies on the ranks of `group` differ:
// the first of the experts spread inside `group`, or vocabulary_key of a vocabulary piece split
// across its batches; -1 when every rank of `group` holding it holds the same piece. Raises for a
// cut that splits the same batch's gradient across ranks of `group`.
int64_t piece_inside(const std::string& name, const Tensor& p, const dist::Group& group,
                     const char* op) {
  const Placement* placement = placement_of(p);
  if (placement == nullptr) return -1;
  if (placement->context && placement->context->size() > 1) {
    std::vector<int> left_out;
    for (int r : placement->context->ranks())
      if (!group.contains(r)) left_out.push_back(r);
    WEAVE_CHECK(left_out.empty(), op,
                "parameter '{}' is read in parts of each sequence by the ranks of context group "
                "{}, and group {} leaves out ranks {}: their parts of the gradient would never "
                "be added, and the copies would drift apart; hint: wrap over "
                "mesh.data_and_context()",
                name, placement->context->str(), group.str(), fmt::join(left_out, ", "));
  }
  int64_t first = -1;
  for (const Cut& cut : placement->cuts) {
    int64_t shared = 0;
    for (int r : cut.group.ranks()) shared += group.contains(r) ? 1 : 0;
    const bool experts = cut.kind == Cut::Kind::Experts && cut.group.size() > 1;
    const bool vocabulary = cut.kind == Cut::Kind::Split && cut.across_batches;
    // Expert ranks read different batches: a data-parallel group must take them in.
    WEAVE_CHECK(!(experts || vocabulary) || shared > 1, op,
                "parameter '{}' is {}, outside group {}: its gradient sums the batches of that "
                "group, which the group's average would leave out; hint: wrap over every rank "
                "that reads a different batch, e.g. mesh.shard() or mesh.group({{Axis::Data, "
                "Axis::Context}}), which takes them in",
                name, cut.str(), group.str());
    if (shared <= 1) continue;  // the cut runs across the group: every rank of it holds its piece
    if (vocabulary) {
      first = vocabulary_key(cut.group.rank());
      continue;
    }
    WEAVE_CHECK(experts, op,
                "parameter '{}' is {}, which shares ranks with group {}: those ranks hold "
                "different pieces of one batch's gradient, not replicas; hint: wrap over the "
                "ranks that read different batches, e.g. mesh.group({{Axis::Data, "
                "Axis::Context}})",
                name, cut.str(), group.str());
    WEAVE_CHECK(shared == cut.group.size(), op,
                "parameter '{}' is {}, partly outside group {}; hint: spread the experts over "
                "a sub-axis of the data-parallel ranks (mesh.expert())",
                name, cut.str(), group.str());
    first = cut.first;
  }
  return first;
}

}  // namespace

ReplicaGroups replica_groups(const std::vector<std::string>& names,
                             const std::vector<Tensor>& params, const dist::Group& group,
                             const char* op) {
  std::string mine;
  check_together(
      [&] {
        for (size_t i = 0; i < params.size(); ++i)
          mine += fmt::format("{},", piece_inside(names[i], params[i], group, op));
      },
      group, op);
  const std::vector<std::string> all = all_gather_bytes(mine, group);
  ReplicaGroups out{
      .groups = {group}, .of = std::vector<int>(params.size(), 0), .vocabulary = {false}};
  std::vector<std::vector<std::vector<int>>> partitions = {{group.ranks()}};
  std::vector<size_t> at(all.size(), 0);  // parse position in each rank's list
  for (size_t i = 0; i < params.size(); ++i) {
    std::map<int64_t, std::vector<int>> holders;  // first expert -> global ranks
    for (size_t r = 0; r < all.size(); ++r) {
      const size_t comma = all[r].find(',', at[r]);
      holders[std::stoll(all[r].substr(at[r], comma - at[r]))].push_back(group.global_rank(int(r)));
      at[r] = comma + 1;
    }
    if (holders.size() == 1 && holders.begin()->first == -1) continue;
    WEAVE_CHECK(!holders.contains(-1), op,
                "parameter '{}' is spread (as experts or vocabulary pieces) on some ranks of "
                "group {} and not on ranks {}; hint: build the same model on every rank",
                names[i], group.str(), holders[-1]);
    const bool vocabulary = holders.begin()->first < -1;
    std::vector<std::vector<int>> partition;
    for (auto& [first, ranks] : holders) partition.push_back(std::move(ranks));
    size_t found = 0;  // experts and vocabulary pieces keep groups of their own
    while (found < partitions.size() &&
           !(partitions[found] == partition && out.vocabulary[found] == vocabulary))
      ++found;
    if (found == partitions.size()) {
      out.groups.push_back(dist::split_group(group, partition));
      out.vocabulary.push_back(vocabulary);
      partitions.push_back(std::move(partition));
    }
    out.of[i] = int(found);
  }
  return out;
}

void check_replicated(const std::vector<std::string>& names, const std::vector<Tensor>& params,
                      const dist::Group& group, const char* op, const std::string& hint) {
  check_together(
      [&] {
        for (size_t i = 0; i < params.size(); ++i) {
          const std::string name = i < names.size() ? names[i] : fmt::format("parameter {}", i);
          const int64_t piece = piece_inside(name, params[i], group, op);
          WEAVE_CHECK(piece == -1, op,
                      "'{}' is one of the {} spread over ranks of group {}: each rank holds "
                      "others, and averaging every parameter over the group would mix them; "
                      "hint: {}",
                      name, piece < -1 ? "vocabulary pieces" : "experts", group.str(),
                      piece < -1 ? "build the model without ModelSplit::shard_vocabulary, or "
                                   "train it under DistributedDataParallel or "
                                   "FullyShardedDataParallel"
                                 : hint);
        }
      },
      group, op);
}

bool spread_expert_in(const Tensor& p, const dist::Group& group) {
  const Placement* placement = placement_of(p);
  if (placement == nullptr) return false;
  for (const Cut& cut : placement->cuts)
    if (cut.kind == Cut::Kind::Experts && cut.group.size() > 1 &&
        group.contains(cut.group.global_rank(0)))
      return true;
  return false;
}

bool spread_piece_in(const Tensor& p, const dist::Group& group) {
  if (spread_expert_in(p, group)) return true;
  const Placement* placement = placement_of(p);
  if (placement == nullptr) return false;
  for (const Cut& cut : placement->cuts) {
    if (cut.kind != Cut::Kind::Split || !cut.across_batches) continue;
    int shared = 0;
    for (int r : cut.group.ranks()) shared += group.contains(r) ? 1 : 0;
    if (shared > 1) return true;
  }
  return false;
}

}  // namespace detail

}  // namespace weave::parallel
