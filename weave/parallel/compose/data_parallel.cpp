#include "weave/parallel/compose/data_parallel.h"

#include "weave/parallel/core/readiness.h"

namespace weave::parallel {

namespace {

constexpr const char* kDataParallel = "data_parallel";

// Nothing to average here (one replica, or an optimizer that averages in its step): the model
// itself behind the wrappers' face.
class SingleReplica : public DataParallelWrapper {
 public:
  SingleReplica(nn::Module& module, dist::Group alone)
      : module_(module),
        alone_(std::move(alone)),
        readiness_(detail::GradReadiness::create({}, {})) {}
  Tensor forward(const nn::Inputs& inputs) override { return module_(inputs); }
  NoSyncGuard no_sync() override { return NoSyncGuard(readiness_); }
  nn::Module& module() override { return module_; }
  const dist::Group& group() const override { return alone_; }
  std::vector<Tensor> trained_parameters() const override {
    return nn::trainable_parameters(module_);
  }

 private:
  nn::Module& module_;
  dist::Group alone_;
  std::shared_ptr<detail::GradReadiness> readiness_;
};

}  // namespace

std::unique_ptr<DataParallelWrapper> data_parallel(nn::Module& model, const ProcessMesh& mesh,
                                                   DataParallelOptions options) {
  // Local facts, the same on every rank of the mesh: each raises alike.
  WEAVE_CHECK(!options.fsdp.group && !options.fsdp.replicate_group && !options.ddp.group,
              kDataParallel,
              "the groups come from the mesh, found a group set in the options; hint: leave "
              "fsdp.group, fsdp.replicate_group and ddp.group unset, or build the wrapper "
              "yourself");
  const MeshShape& shape = mesh.shape();
  WEAVE_CHECK(options.shard || shape.replicate == 1, kDataParallel,
              "the mesh splits its data axis into {} replicas (HSDP), which needs sharding, "
              "found shard false; hint: {{.shard = true}}, or a mesh without replicate",
              shape.replicate);
  WEAVE_CHECK(!(options.shard && options.optimizer_averages), kDataParallel,
              "optimizer_averages leaves the gradients to the optimizer's step, but shard asks "
              "FSDP to reduce-scatter them; hint: one of the two");
  if (options.optimizer_averages)  // group(): where the optimizer averages
    return std::make_unique<SingleReplica>(model, mesh.data_and_context());
  if (options.shard) {
    options.fsdp.group = mesh.shard();
    if (shape.replicate > 1) options.fsdp.replicate_group = mesh.replicate();
    return std::make_unique<FullyShardedDataParallel>(model, options.fsdp);
  }
  const dist::Group& replicas = mesh.data_and_context();
  // One rank still sums its micro-batches reproducibly, as DDP does at any size.
  if (replicas.size() == 1 && !options.ddp.reproducible)
    return std::make_unique<SingleReplica>(model, replicas);
  options.ddp.group = replicas;
  return std::make_unique<DistributedDataParallel>(model, options.ddp);
}

double replica_mean(const Tensor& loss, const ProcessMesh& mesh) {
  const double share = double(mesh.data_and_context().size());
  const double mine = loss.defined() ? loss.detach().to(kCPU).to(kFloat64).item<double>() : 0;
  Tensor sum = full({1}, mine / share, {.dtype = kFloat64});
  dist::all_reduce(sum, dist::ReduceOp::Sum,
                   mesh.group({Axis::Data, Axis::Context, Axis::Pipeline}));
  return sum.item<double>();
}

}  // namespace weave::parallel
