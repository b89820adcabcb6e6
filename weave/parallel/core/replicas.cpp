// Replicas: model agreement, and the bucketed broadcast and averaging both strategies and users
// call.
#include "weave/parallel/core/replicas.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <set>

#include "weave/autograd/grad_mode.h"
#include "weave/nn/deferred.h"
#include "weave/ops/ops.h"
#include "weave/parallel/core/agree.h"
#include "weave/parallel/core/mesh.h"
#include "weave/parallel/core/placement.h"
#include "weave/tensor/checksum.h"

namespace weave::parallel {

namespace {

constexpr double kBroadcastBucketMb = 25.0;

// One flat bucket: consecutive tensors of one dtype and device, packed.
struct Packed {
  std::vector<Tensor> members;
  Tensor flat, wire;  // wire: what travels (flat, or flat narrowed to a compressed dtype)
  dist::Work work;
};

std::vector<Packed> pack(const std::vector<Tensor>& tensors, double bucket_mb) {
  std::vector<Packed> buckets;
  const double cap = bucket_mb * 1024 * 1024;
  double bytes = 0;
  for (const Tensor& t : tensors) {
    if (!t.defined()) continue;
    const double size = double(t.numel()) * double(t.itemsize());
    if (buckets.empty() || buckets.back().members.front().dtype() != t.dtype() ||
        buckets.back().members.front().device() != t.device() || bytes + size > cap) {
      buckets.emplace_back();
      bytes = 0;
    }
    buckets.back().members.push_back(t);
    bytes += size;
  }
  for (Packed& b : buckets) {
    std::vector<Tensor> pieces;
    for (const Tensor& t : b.members) pieces.push_back(t.reshape({-1}));
    b.flat = cat(pieces);
  }
  return buckets;
}

// Launches `collective` on every bucket before waiting for any, then writes the results back.
void run_packed(const std::vector<Tensor>& tensors, double bucket_mb,
                const std::function<void(Packed&)>& collective) {
  NoGradGuard no_grad;
  std::vector<Packed> buckets = pack(tensors, bucket_mb);
  for (Packed& b : buckets) collective(b);
  for (Packed& b : buckets) {
    b.work.wait();
    if (!b.wire.is_same(b.flat)) b.flat.copy_(b.wire);
    int64_t offset = 0;
    for (Tensor& t : b.members) {
      t.copy_(b.flat.narrow(0, offset, t.numel()).reshape(t.shape()));
      offset += t.numel();
    }
  }
}

// The tensors that some rank of the group holds otherwise than group rank `root`: a checksum
// agreement (one all_gather of 8 bytes a tensor) in place of a broadcast, so replicas built
// alike (a seeded model, a checkpoint every rank loaded) send and pack nothing. A device tensor
// counts as differing: its checksum would cost a copy to the host, more than its broadcast.
std::vector<Tensor> differing_from(const std::vector<Tensor>& tensors, int root,
                                   const dist::Group& group) {
  std::string mine;
  for (const Tensor& t : tensors) {
    const uint64_t sum = t.defined() && t.device().is_cpu() ? checksum64(t) : 0;
    mine.append(reinterpret_cast<const char*>(&sum), sizeof sum);
    mine.push_back(t.defined() && t.device().is_cpu() ? 'c' : 'd');
  }
  const std::vector<std::string> all = detail::all_gather_bytes(mine, group);
  std::vector<Tensor> out;
  for (size_t k = 0; k < tensors.size(); ++k) {
    const auto entry = [&](int r) { return all[size_t(r)].substr(9 * k, 9); };
    bool differs = entry(root).back() == 'd';
    for (int r = 0; r < group.size() && !differs; ++r) differs = entry(r) != entry(root);
    if (differs) out.push_back(tensors[k]);
  }
  return out;
}

}  // namespace

void broadcast_parameters(nn::Module& module, int root,
                          const std::optional<dist::Group>& group_option) {
  const dist::Group group = detail::data_parallel_group(group_option, "broadcast_parameters");
  std::vector<Tensor> tensors = module.parameters();
  for (const Tensor& b : module.buffers()) tensors.push_back(b);
  detail::broadcast_packed(differing_from(tensors, root, group), root, group);
}

void check_same_model(const nn::Module& module, const std::optional<dist::Group>& group_option) {
  detail::check_same_model(module, detail::data_parallel_group(group_option, "check_same_model"),
                           "check_same_model");
}

void broadcast_optimizer_state(optim::Optimizer& optimizer, int root,
                               const std::optional<dist::Group>& group_option) {
  const dist::Group group = detail::data_parallel_group(group_option, "broadcast_optimizer_state");
  NoGradGuard no_grad;
  std::vector<Tensor> state = optimizer.state();
  // Same number of state tensors everywhere, or the broadcasts below would not pair up.
  const detail::ValueRange counts = detail::value_range({int64_t(state.size())}, group);
  WEAVE_CHECK(counts.same(0), "broadcast_optimizer_state",
              "ranks hold different optimizer states ({} to {} state tensors); hint: broadcast "
              "before the first step, or after the same number of steps everywhere",
              counts.lowest[0], counts.highest[0]);
  for (const Tensor& t : state) dist::broadcast(t, root, group);
  Tensor lr = full({1}, optimizer.lr(), {.dtype = kFloat64});
  dist::broadcast(lr, root, group);
  optimizer.set_lr(lr.item<double>());
}

void average_gradients(const std::vector<Tensor>& params, const dist::Group& group,
                       double bucket_mb, std::optional<DType> compress) {
  NoGradGuard no_grad;
  std::vector<Tensor> grads;
  for (const Tensor& p : params) {
    if (!p.defined() || !p.requires_grad()) continue;
    if (!p.grad().defined()) p.set_grad(zeros_like(p));
    grads.push_back(p.grad());
  }
  average_tensors(grads, group, bucket_mb, compress);
}

void average_tensors(const std::vector<Tensor>& tensors, const dist::Group& group, double bucket_mb,
                     std::optional<DType> compress) {
  WEAVE_CHECK(bucket_mb > 0, "average_tensors", "bucket_mb must be positive, found {}", bucket_mb);
  run_packed(tensors, bucket_mb, [&](Packed& b) {
    b.wire = compress && *compress != b.flat.dtype() ? b.flat.to(*compress) : b.flat;
    b.work = dist::all_reduce(b.wire, dist::ReduceOp::Avg, group, /*async_op=*/true);
  });
}

namespace {

// "<name>@<place in each cut group>": the same on the ranks that hold copies of one piece.
std::string piece_key(const std::string& name, const Tensor& p) {
  std::string key = name + "@";
  if (const Placement* placement = placement_of(p))
    for (const Cut& cut : placement->cuts) {
      key += fmt::format("{}:{},", static_cast<int>(cut.kind), cut.group.rank());
      // A flat shard's members may be slices themselves (tensor-parallel layers, vocabulary
      // pieces): which slices is part of which piece the shard holds.
      if (cut.layout)
        for (const TensorSplit& split : cut.layout->splits)
          if (split.count > 1) key += fmt::format("s{}/{},", split.index, split.count);
    }
  return key;
}

}  // namespace

void materialize(nn::Module& module) {
  const dist::KeepAlive alive;  // drawing a large model may outlast weave-run's --hang-timeout
  detail::Verdict verdict("materialize");
  detail::agree_on_seeds_over_cuts(module, verdict);
  verdict.raise_if_failed();
  nn::materialize(module);
}

int64_t check_replicas(const nn::Module& module, const dist::Group& group) {
  const char* op = "check_replicas";
  WEAVE_CHECK(group.rank() >= 0, op, "rank {} is not in group {}", dist::rank(), group.str());
  const detail::CopiesCompared compared =
      detail::compare_copies(module, group, [](const Tensor& p) { return p; });
  WEAVE_CHECK(compared.parameter.empty(), op,
              "parameter '{}' differs across the ranks that should hold copies of it ({}); hint: "
              "a replica clipped, scaled or stepped on its own (a local clip_grad_norm_ on a "
              "spread parameter, a step skipped on one rank), or a placement is declared wrongly",
              compared.parameter, compared.sides);
  return compared.checked;
}

namespace detail {

CopiesCompared compare_copies(const nn::Module& module, const dist::Group& group,
                              const std::function<Tensor(const Tensor&)>& value) {
  std::string mine;
  for (const auto& [name, p] : module.named_parameters()) {
    if (!p.defined()) continue;
    const Tensor v = value(p);
    if (v.defined()) mine += fmt::format("{} {:08x}\n", piece_key(name, p), checksum(v));
  }
  // piece -> checksum -> global ranks holding that value
  std::map<std::string, std::map<std::string, std::vector<int>>> copies;
  const std::vector<std::string> all = detail::all_gather_bytes(mine, group);
  for (int r = 0; r < group.size(); ++r)
    for (size_t start = 0; start < all[size_t(r)].size();) {
      const size_t end = all[size_t(r)].find('\n', start), space = all[size_t(r)].rfind(' ', end);
      copies[all[size_t(r)].substr(start, space - start)]
            [all[size_t(r)].substr(space + 1, end - space - 1)]
                .push_back(group.global_rank(r));
      start = end + 1;
    }
  CopiesCompared compared;
  for (const auto& [key, values] : copies) {
    size_t holders = 0;
    for (const auto& [sum, ranks] : values) holders += ranks.size();
    if (holders > 1) ++compared.checked;
    if (values.size() == 1 || !compared.parameter.empty()) continue;
    compared.parameter = key.substr(0, key.find('@'));
    for (const auto& [sum, ranks] : values)
      compared.sides += fmt::format("{}ranks {} hold checksum {}",
                                    compared.sides.empty() ? "" : "; ", ranks, sum);
  }
  return compared;
}

constexpr const char* kSameModelHint =
    "build the same model (same layers, shapes and dtypes) on every rank";

void broadcast_packed(const std::vector<Tensor>& tensors, int root, const dist::Group& group) {
  run_packed(tensors, kBroadcastBucketMb, [&](Packed& b) {
    b.wire = b.flat;
    b.work = dist::broadcast(b.wire, root, group, /*async_op=*/true);
  });
}

void broadcast_replicas(nn::Module& module, const std::vector<Tensor>& params,
                        const ReplicaGroups& replicas, int root) {
  const dist::Group& group = replicas.groups[0];
  // Deferred parameters need none: every rank draws the same values by name (deferred.h), and
  // check_same_model saw them deferred on every rank.
  // What differs across the group (spread experts, vocabulary pieces, frozen or not) comes
  // from its own replica group's first rank.
  std::vector<Tensor> dense = module.buffers();
  for (const Tensor& p : module.parameters())
    if (!spread_piece_in(p, group) && !nn::is_deferred(p)) dense.push_back(p);
  broadcast_packed(differing_from(dense, root, group), root, group);
  for (size_t k = 1; k < replicas.groups.size(); ++k) {
    std::vector<Tensor> members = replicas.members(params, int(k));
    std::erase_if(members, [](const Tensor& p) { return nn::is_deferred(p); });
    broadcast_packed(differing_from(members, 0, replicas.groups[k]), 0, replicas.groups[k]);
  }
}

std::vector<std::string> model_lines(const nn::Module& module, const dist::Group& group,
                                     bool with_seeds) {
  std::vector<std::string> lines;
  for (const auto& [name, t] : module.named_parameters()) {
    // Experts spread over ranks of the group are named by their global index, which differs.
    const bool spread_here = spread_expert_in(t, group);
    const bool deferred = nn::is_deferred(t);
    lines.push_back(fmt::format(
        "parameter {} {} {}{}", spread_here ? "(one of the experts)" : name, t.dtype(), t.shape(),
        !deferred     ? ""
        : !with_seeds ? " (deferred)"
                      : fmt::format(" (deferred, seed {})", *nn::init_seed(t))));
  }
  for (const auto& [name, t] : module.named_buffers())
    lines.push_back(fmt::format("buffer {} {} {}", name, t.dtype(), t.shape()));
  return lines;
}

void check_same_model(const nn::Module& module, const dist::Group& group, const char* op) {
  check_same_lines(model_lines(module, group, /*with_seeds=*/false), group, op, "the model",
                   kSameModelHint);
}

std::string init_seeds(const std::vector<Tensor>& params) {
  std::set<uint64_t> seeds;
  for (const Tensor& p : params)
    if (const std::optional<uint64_t> seed = nn::init_seed(p)) seeds.insert(*seed);
  return fmt::format("{}", fmt::join(seeds, ", "));
}

void agree_on_seeds(const std::string& seeds, const dist::Group& group, Verdict& verdict) {
  const std::vector<std::string> all = all_gather_bytes(seeds, group);
  for (int r = 0; r < group.size(); ++r)
    for (int q = r + 1; q < group.size(); ++q)
      if (!all[size_t(r)].empty() && !all[size_t(q)].empty() && all[size_t(r)] != all[size_t(q)])
        verdict.note(fmt::format(
            "the ranks of group {} hold pieces of one model drawn from different "
            "nn::DeferredInit seeds: rank {} from seed {}, rank {} from seed {}, so the model "
            "would be one that no layout holds; hint: build the model under the same "
            "nn::DeferredInit(seed) on every rank",
            group.str(), group.global_rank(r), all[size_t(r)], group.global_rank(q),
            all[size_t(q)]));
  verdict.share(group);
}

void agree_on_seeds_over_cuts(const nn::Module& module, Verdict& verdict) {
  for (const Cut::Kind kind : {Cut::Kind::Split, Cut::Kind::Experts}) {
    std::vector<dist::Group> groups;
    for (const auto& [name, p] : module.named_parameters())
      if (const Placement* placement = placement_of(p))
        for (const Cut& cut : placement->cuts)
          if (cut.kind == kind && cut.group.size() > 1 &&
              std::none_of(groups.begin(), groups.end(),
                           [&](const dist::Group& g) { return g.ranks() == cut.group.ranks(); }))
            groups.push_back(cut.group);
    for (const dist::Group& group : groups)
      agree_on_seeds(init_seeds(module.parameters()), group, verdict);
  }
}

void materialize_replicas(nn::Module& module, const dist::Group& group, const char* op) {
  Verdict verdict(op);
  agree_on_seeds_over_cuts(module, verdict);
  verdict.note(lines_disagreement(model_lines(module, group, /*with_seeds=*/false), group,
                                  "the model", kSameModelHint));
  verdict.share(group);
  verdict.raise_if_failed();
  nn::materialize(module);
}

}  // namespace detail

}  // namespace weave::parallel
