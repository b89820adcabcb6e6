// An FSDP unit's flat buffers and the collectives of its life cycle.
#include "weave/parallel/data_parallel/fsdp_unit.h"

#include <algorithm>
#include <tuple>

#include "weave/autograd/grad_mode.h"
#include "weave/nn/deferred.h"
#include "weave/ops/ops.h"
#include "weave/parallel/core/placement.h"
#include "weave/tensor/tensor_impl.h"

namespace weave::parallel::detail {

namespace {

// This rank's slice of a flat buffer of parameters some of which are deferred: each deferred
// member's elements in the slice drawn directly, by the member's name (deferred.h), the others'
// copied, the padding zero. Nothing else of a deferred model is ever allocated here.
Tensor draw_shard(const FlatBuffer& full, const std::vector<Tensor>& members,
                  const std::vector<int>& indices, const std::vector<std::string>& names,
                  const dist::Group& group) {
  const int64_t per_rank = full.flat.numel() / group.size(), first = group.rank() * per_rank;
  Tensor shard = zeros({per_rank}, {.dtype = full.flat.dtype(), .device = full.flat.device()});
  for (size_t k = 0; k < members.size(); ++k) {
    const int64_t begin = full.offsets[k], end = begin + members[k].numel();
    const int64_t lo = std::max(begin, first), hi = std::min(end, first + per_rank);
    if (lo >= hi) continue;
    Tensor into = shard.narrow(0, lo - first, hi - lo);
    if (nn::is_deferred(members[k])) {
      nn::draw_deferred(members[k], names[size_t(indices[k])], lo - begin, into);
    } else {
      NoGradGuard no_grad;
      into.copy_(members[k].detach().reshape({members[k].numel()}).narrow(0, lo - begin, hi - lo));
    }
  }
  return shard;
}

// Under a mixed-precision policy the members move to a gathered buffer of param_dtype (their
// values live on in the shard, which keeps their dtype).
void gather_in(FSDPFlat& f, const std::vector<Tensor>& members, DType dtype) {
  if (dtype == f.full.flat.dtype()) return;
  f.full = FlatBuffer::unallocated(members, f.group.size(), dtype);
  for (size_t k = 0; k < members.size(); ++k) bind_storage(members[k], f.full.view(k));
}

// "" for the wrapper's group, "_experts", "_experts2", ... for the experts' groups and
// "_vocabulary" for the vocabulary pieces'.
std::string replica_suffix(const ReplicaGroups& replicas, int replica) {
  if (replica == 0) return "";
  if (replicas.vocabulary[size_t(replica)]) return "_vocabulary";
  int experts = 0;
  for (int k = 1; k <= replica; ++k) experts += replicas.vocabulary[size_t(k)] ? 0 : 1;
  return experts == 1 ? "_experts" : fmt::format("_experts{}", experts);
}

FSDPFlat make_flat(std::vector<int> indices, const std::vector<Tensor>& params,
                   const std::vector<std::string>& names,
                   const std::map<std::string, TensorSplit>& splits, const ReplicaGroups& replicas,
                   int replica, const FSDPOptions& precision) {
  FSDPFlat f;
  f.params = std::move(indices);
  f.group = replicas.groups[size_t(replica)];
  f.scale = replicas.scale(replica);
  f.suffix = replica_suffix(replicas, replica);
  const dist::Group& group = f.group;
  const int64_t n = group.size();
  const std::vector<Tensor> members = FSDPUnit::members(f, params);
  f.frozen = !members[0].requires_grad();
  if (f.frozen) f.suffix += "_frozen";
  if (std::any_of(members.begin(), members.end(), nn::is_deferred)) {  // alike on every rank
    f.full = FlatBuffer::unallocated(members, n);
    f.shard = draw_shard(f.full, members, f.params, names, group);
    for (size_t k = 0; k < members.size(); ++k) bind_storage(members[k], f.full.view(k));
  } else {
    f.full = FlatBuffer::adopt(members, n);
    const int64_t per_rank = f.full.flat.numel() / n;
    NoGradGuard no_grad;
    f.shard = f.full.flat.narrow(0, group.rank() * per_rank, per_rank).clone().detach();
  }
  const int64_t per_rank = f.full.flat.numel() / n;
  if (precision.offload_to_cpu) {
    WEAVE_CHECK(f.shard.device().is_cuda(), "FullyShardedDataParallel",
                "offload_to_cpu moves the shards of CUDA parameters to the host, but '{}' is on "
                "{}; hint: move the model to the GPU first (model.to(Device::cuda()))",
                names[size_t(f.params[0])], f.shard.device());
    f.shard = f.shard.to(kCPU).detach();
  }
  gather_in(f, members, precision.param_dtype.value_or(f.shard.dtype()));
  f.alone = n == 1 && replicas.vocabulary[size_t(replica)] &&
            f.full.flat.dtype() == f.shard.dtype() && f.full.flat.device() == f.shard.device();
  if (f.alone) {  // nothing to gather: the members live in the shard
    f.full.flat = f.shard.detach();
    for (size_t k = 0; k < members.size(); ++k) bind_storage(members[k], f.full.view(k));
  }
  f.shard.requires_grad_(!f.frozen);
  f.reduce_dtype = precision.reduce_dtype.value_or(f.full.flat.dtype());
  if (replica == 0 || replicas.vocabulary[size_t(replica)]) f.replicate = precision.replicate_group;
  // Sharded checkpoints describe the shard by the parameters it covers.
  auto layout = std::make_shared<FlatShard>(FlatShard{.members = {},
                                                      .names = {},
                                                      .splits = {},
                                                      .offsets = f.full.offsets,
                                                      .shapes = f.full.shapes,
                                                      .begin = group.rank() * per_rank});
  for (int i : f.params) {
    layout->members.push_back(params[size_t(i)].impl());
    layout->names.push_back(names[size_t(i)]);
    auto split = splits.find(names[size_t(i)]);
    layout->splits.push_back(split == splits.end() ? TensorSplit{} : split->second);
  }
  add_cut(f.shard, {.kind = Cut::Kind::FlatShard, .group = group, .layout = std::move(layout)},
          "clip with fsdp.clip_grad_norm_(max_norm), or parallel::clip_grad_norm_, which take "
          "the norm over every rank's shard");
  // Experts: which ones the shard covers, as its members say (a vocabulary piece's split is
  // the layout's, like a tensor-parallel member's).
  if (replica > 0 && !replicas.vocabulary[size_t(replica)])
    for (const Cut& cut : placement_of(params[size_t(f.params[0])])->cuts)
      if (cut.kind == Cut::Kind::Experts) add_cut(f.shard, cut);
  f.gathered_version = f.shard.version();
  return f;
}

// An averaged gradient shard in the shard's dtype and place (the host, under CPU offload).
Tensor as_shard_gradient(const FSDPFlat& f, const Tensor& reduced) {
  Tensor out = reduced;
  if (out.dtype() != f.shard.dtype()) out = out.to(f.shard.dtype());
  if (out.device() != f.shard.device()) out = out.to(f.shard.device());
  return out;
}

bool needs_gather(const FSDPFlat& f) {
  return !f.alone && (f.full.flat.storage()->released() || f.gathered_version != f.shard.version());
}

}  // namespace

FSDPUnit::FSDPUnit(std::string name, std::vector<nn::Module*> modules, bool root,
                   const std::vector<int>& members, const std::vector<Tensor>& params,
                   const std::vector<std::string>& names,
                   const std::map<std::string, TensorSplit>& splits, const ReplicaGroups& replicas,
                   const FSDPOptions& precision)
    : name_(std::move(name)), modules_(std::move(modules)), root_(root) {
  using Kind = std::tuple<int, DType, Device, bool>;  // replica group, dtype, device, frozen
  auto kind_of = [&](int i) {
    const Tensor& p = params[size_t(i)];
    return Kind{replicas.of[size_t(i)], p.dtype(), p.device(), !p.requires_grad()};
  };
  std::vector<Kind> kinds;
  for (int i : members)
    if (std::find(kinds.begin(), kinds.end(), kind_of(i)) == kinds.end())
      kinds.push_back(kind_of(i));
  for (const Kind& kind : kinds) {
    std::vector<int> of_kind;
    for (int i : members)
      if (kind_of(i) == kind) of_kind.push_back(i);
    flats_.push_back(make_flat(std::move(of_kind), params, names, splits, replicas,
                               std::get<0>(kind), precision));
  }
}

std::vector<Tensor> FSDPUnit::members(const FSDPFlat& f, const std::vector<Tensor>& params) {
  std::vector<Tensor> out;
  for (int i : f.params) out.push_back(params[size_t(i)]);
  return out;
}

void FSDPUnit::launch_gather(FSDPStats& stats, bool prefetch) {
  if (params_ == Params::Gathering) return;
  for (FSDPFlat& f : flats_) {
    if (!needs_gather(f)) continue;
    if (f.gathered_version == f.shard.version())
      f.refill_version = f.full.flat.storage()->version();
    f.full.flat.storage()->allocate_again();
    f.gathered_version = f.shard.version();
    NoGradGuard no_grad;
    // In the gathered dtype, on the gathered buffer's device (a CPU-offloaded shard is copied).
    f.gather_send = f.shard.detach();
    if (f.gather_send.device() != f.full.flat.device())
      f.gather_send = f.gather_send.to(f.full.flat.device());
    if (f.gather_send.dtype() != f.full.flat.dtype())
      f.gather_send = f.gather_send.to(f.full.flat.dtype());
    f.gather = dist::all_gather(f.full.flat, f.gather_send, f.group, /*async_op=*/true);
    ++stats.gathers;
    stats.gathered_bytes += f.full.flat.numel() * int64_t(f.full.flat.itemsize());
    if (prefetch) ++stats.prefetches;
  }
  params_ = Params::Gathering;
}

void FSDPUnit::wait_gather() {
  if (params_ != Params::Gathering) return;
  params_ = Params::Gathered;
  std::exception_ptr first_error;
  for (FSDPFlat& f : flats_) {
    if (!f.gather) continue;
    const dist::Work work = *std::exchange(f.gather, std::nullopt);
    try {
      work.wait();
      if (f.refill_version) f.full.flat.storage()->restore_version(*f.refill_version);
    } catch (...) {
      // The peers never ran it (the check raised): what `full` holds is no gather.
      f.gathered_version = ~uint64_t{0};
      if (!first_error) first_error = std::current_exception();
    }
    f.refill_version.reset();
    f.gather_send = Tensor();
  }
  if (first_error) std::rethrow_exception(first_error);
}

void FSDPUnit::ensure_gathered(FSDPStats& stats) {
  launch_gather(stats, /*prefetch=*/false);
  wait_gather();
}

void FSDPUnit::release(bool full_shard) {
  wait_gather();  // a prefetch whose unit did not run (a skipped branch) still completes here
  if (!full_shard) return;
  for (FSDPFlat& f : flats_)
    if (!f.alone) f.full.flat.storage()->release();
  params_ = Params::Sharded;
}

void FSDPUnit::bind_grads(const std::vector<Tensor>& params) {
  for (FSDPFlat& f : flats_) {
    if (f.frozen) continue;
    if (!f.grads.flat.defined()) f.grads = FlatBuffer::like(members(f, params), f.group.size());
    for (size_t k = 0; k < f.params.size(); ++k)
      bind_grad(params[size_t(f.params[k])], f.grads.view(k));
  }
  if (grads_ == Grads::Idle) grads_ = Grads::Accumulating;
}

void FSDPUnit::launch_reduce(const std::vector<Tensor>& params, FSDPStats& stats) {
  bind_grads(params);  // parameters without a gradient contribute zeros
  NoGradGuard no_grad;
  grads_ = Grads::Reducing;  // before the calls: finish_reduce waits for the ones that started
  for (FSDPFlat& f : flats_) {
    if (f.frozen) continue;
    if (f.sums) {  // reproducible: into the sums now, reduced when the step settles
      f.sums->fold();
      continue;
    }
    if (f.alone) {  // the sum over one rank is its own gradient, in its own dtype
      f.reduced = f.grads.flat;
      continue;
    }
    f.grads_wire =
        f.grads.flat.dtype() == f.reduce_dtype ? f.grads.flat : f.grads.flat.to(f.reduce_dtype);
    f.reduced = empty(f.shard.shape(), {.dtype = f.reduce_dtype, .device = f.grads_wire.device()});
    f.reduce = dist::reduce_scatter(f.reduced, f.grads_wire, dist::ReduceOp::Avg, f.group,
                                    /*async_op=*/true);
    ++stats.reduce_scatters;
    stats.reduced_bytes += f.grads_wire.numel() * int64_t(f.grads_wire.itemsize());
  }
}

void FSDPUnit::finish_reduce(const std::vector<Tensor>& params) {
  if (grads_ != Grads::Reducing) return;
  grads_ = Grads::Idle;
  std::exception_ptr first_error;
  for (FSDPFlat& f : flats_) {
    if (f.frozen) continue;
    if (f.sums) {  // folded at launch: nothing in flight
      for (int i : f.params) params[size_t(i)].set_grad(Tensor());
      f.grads = {};
      continue;
    }
    if (f.reduce) try {
        std::exchange(f.reduce, std::nullopt)->wait();
      } catch (...) {
        f.reduced = Tensor();  // it never ran: no average to keep
        if (!first_error) first_error = std::current_exception();
      }
    NoGradGuard no_grad;
    if (f.replicate) {  // the replicas pair with this call whatever happened here: zeros if so
      if (!f.reduced.defined())
        f.reduced =
            zeros(f.shard.shape(), {.dtype = f.reduce_dtype, .device = f.grads.flat.device()});
      f.replicate_reduce =
          dist::all_reduce(f.reduced, dist::ReduceOp::Avg, *f.replicate, /*async_op=*/true);
    } else if (f.reduced.defined()) {
      f.reduced = as_shard_gradient(f, f.reduced);
      if (f.scale != 1.0) f.reduced.mul_(f.scale);
    }
    for (int i : f.params) params[size_t(i)].set_grad(Tensor());
    f.grads = {};
    f.grads_wire = Tensor();
  }
  if (first_error) std::rethrow_exception(first_error);
}

void FSDPUnit::finish_replicate() {
  std::exception_ptr first_error;
  for (FSDPFlat& f : flats_) {
    if (!f.replicate_reduce) continue;
    try {
      std::exchange(f.replicate_reduce, std::nullopt)->wait();
      NoGradGuard no_grad;
      f.reduced = as_shard_gradient(f, f.reduced);
      if (f.scale != 1.0) f.reduced.mul_(f.scale);
    } catch (...) {
      f.reduced = Tensor();
      if (!first_error) first_error = std::current_exception();
    }
  }
  if (first_error) std::rethrow_exception(first_error);
}

void FSDPUnit::discard_step(const std::vector<Tensor>& params) {
  try {
    wait_gather();
  } catch (const Error&) {  // the step failed already; the gather is redone when next needed
  }
  for (FSDPFlat& f : flats_) {
    if (f.reduce) try {
        std::exchange(f.reduce, std::nullopt)->wait();
      } catch (const Error&) {  // likewise: the step's error is reported
      }
    if (f.replicate_reduce) try {
        std::exchange(f.replicate_reduce, std::nullopt)->wait();
      } catch (const Error&) {
      }
    if (grads_ != Grads::Idle)
      for (int i : f.params) params[size_t(i)].set_grad(Tensor());
    f.grads = {};
    f.grads_wire = Tensor();
    f.reduced = Tensor();
  }
  grads_ = Grads::Idle;
}

void FSDPUnit::settle_reduced(bool keep) {
  for (FSDPFlat& f : flats_) {
    if (keep && f.reduced.defined()) {
      if (f.shard.grad().defined())
        f.shard.grad().add_(f.reduced);
      else
        f.shard.set_grad(f.reduced);
    }
    f.reduced = Tensor();
  }
}

}  // namespace weave::parallel::detail
