// Axes composed inside the library: DistributedDataParallel over data x context reads each
// parameter's placement, so context parallelism (ring attention) and experts spread over a
// sub-axis of data x context train under it, and parallel::clip_grad_norm_ finds the whole
// model's norm. Each case runs 3 AdamW steps with clipping in float64 and ends within 1e-10 of
// one process that trains the same block on the stacked batch and the whole sequence.
#include <doctest/doctest.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "helpers.h"
#include "model_parallel_helpers.h"
#include "weave/weave.h"

using namespace weave;
using weave_test::shared_randn;

namespace {

constexpr int64_t kBatch = 2, kSeq = 8, kDim = 4, kHeads = 2;

nn::MoEOptions moe_options(int64_t experts) {
  return {.hidden = kDim,
          .ffn = 6,
          .router = {.experts = experts, .top_k = 2, .aux_loss_coef = 0.1, .z_loss_coef = 0.01},
          .seed = 7};
}

// Causal attention over the sequence (this rank's part of it through ring attention when a
// context group is given), then a mixture of experts, each with a residual.
class Block : public nn::Module {
 public:
  Block(std::optional<dist::Group> context, std::shared_ptr<nn::Module> moe,
        std::function<Tensor()> aux)
      : context_(std::move(context)), aux_(std::move(aux)) {
    uint64_t seed = 1;
    for (const char* name : {"wq", "wk", "wv", "wo"})
      weights_.push_back(register_parameter(name, shared_randn({kDim, kDim}, seed++) * 0.5));
    moe_ = register_module("moe", std::move(moe));
  }

  Tensor forward(const Tensor& x) override {  // [B, T, D]: this rank's batch and positions
    const int64_t b = x.size(0), t = x.size(1), d = kDim;
    const Tensor flat = x.reshape({b * t, d});
    auto heads = [&](const Tensor& w) {
      return matmul(flat, w).reshape({b, t, kHeads, d / kHeads}).transpose(1, 2);
    };
    const Tensor q = heads(weights_[0]), k = heads(weights_[1]), v = heads(weights_[2]);
    const Tensor a = context_ ? parallel::ring_attention(q, k, v, *context_, {.causal = true})
                              : scaled_dot_product_attention(q, k, v, {.causal = true});
    const Tensor h = flat + matmul(a.transpose(1, 2).reshape({b * t, d}), weights_[3]);
    return (h + (*moe_)(h)).reshape({b, t, d});
  }
  Tensor aux_loss() const { return aux_(); }

 private:
  std::optional<dist::Group> context_;
  std::function<Tensor()> aux_;
  std::vector<Tensor> weights_;
  std::shared_ptr<nn::Module> moe_;
};

// The whole batch of every step: inputs and the weights the loss multiplies outputs by.
Tensor whole_input(int step, int data) {
  return shared_randn({kBatch * data, kSeq, kDim}, 100 + uint64_t(step));
}
Tensor whole_target(int step, int data) {
  return shared_randn({kBatch * data, kSeq, kDim}, 200 + uint64_t(step));
}

// Mean of output * target over the tokens, plus the load-balancing loss.
Tensor objective(Block& block, const Tensor& y, const Tensor& target) {
  return (y * target).sum() / double(y.numel() / kDim) + block.aux_loss();
}

constexpr double kMaxNorm = 0.05;  // below the gradients' norm: every step clips
constexpr optim::AdamWOptions kAdamW{.lr = 0.05, .weight_decay = 0.01};
constexpr double kGroupDecay = 0.3;  // the weight matrices' decay under parameter groups

// One process on the stacked batch and the whole sequence: every expert dense, on this rank.
struct Reference {
  std::shared_ptr<nn::MoE> moe;
  std::shared_ptr<Block> block;
  std::unique_ptr<optim::AdamW> opt;
  std::vector<double> norms;

  explicit Reference(int64_t experts, bool param_groups = false)
      : moe(std::make_shared<nn::MoE>(moe_options(experts))) {
    moe->to(kFloat64);
    block =
        std::make_shared<Block>(std::nullopt, moe, [raw = moe.get()] { return raw->aux_loss(); });
    opt = param_groups ? std::make_unique<optim::AdamW>(
                             optim::weight_decay_groups(*block, kGroupDecay), kAdamW)
                       : std::make_unique<optim::AdamW>(block->parameters(), kAdamW);
  }
  void step(int step, int data) {
    opt->zero_grad();
    objective(*block, (*block)(whole_input(step, data)), whole_target(step, data)).backward();
    // The 1- and infinity norms (max_norm INFINITY: measured, nothing scaled), then the 2-norm,
    // which clips.
    for (double p : {1.0, double(INFINITY)})
      norms.push_back(optim::clip_grad_norm_(block->parameters(), INFINITY, p));
    norms.push_back(optim::clip_grad_norm_(block->parameters(), kMaxNorm));
    opt->step();
  }
  data::TrainingState state() { return {.model = block.get(), .optimizer = opt.get()}; }
};

// This rank's share of a whole batch: its data rows, its context positions.
Tensor share(const Tensor& whole, const parallel::ProcessMesh& mesh) {
  const Tensor rows = whole.narrow(0, mesh.data_rank() * kBatch, kBatch);
  return parallel::shard_sequence(rows, 1, mesh.context()).contiguous();
}

bool close(const Tensor& got, const Tensor& expected) {
  return weave_test::close(got, expected, 1e-10);
}

struct ComposedRun {
  parallel::MeshShape shape;
  int64_t experts_per_rank = 2;
  parallel::DDPOptions ddp = {};
  /// FSDP over data x context instead of DDP (experts sharded over their expert-data group).
  bool fully_sharded = false;
  /// AdamW over optim::weight_decay_groups (through fsdp.param_groups under FSDP): decay on the
  /// weight matrices only, expert shards included.
  bool param_groups = false;
};

// The layer's load-balancing loss over the step's whole batch.
nn::MoEOptions balanced(nn::MoEOptions options, const dist::Group& data) {
  options.reduce_shares = parallel::shares_over(data);
  return options;
}

// The block on a mesh: ring attention over its context axis, experts over its expert axis, and
// DDP or FSDP over data x context, with AdamW and parallel::clip_grad_norm_.
class Composed {
 public:
  explicit Composed(const ComposedRun& run)
      : run_(run),
        mesh_(run.shape),
        moe_(std::make_shared<parallel::ExpertParallelMoE>(
            balanced(moe_options(experts()), mesh_.data_and_context()), mesh_.expert())) {
    moe_->to(kFloat64);
    block_ = std::make_unique<Block>(
        run.shape.context > 1 ? std::optional(mesh_.context()) : std::nullopt, moe_,
        [raw = moe_.get()] { return raw->aux_loss(); });
    if (run.fully_sharded) {
      fsdp_.emplace(*block_, parallel::FSDPOptions{.group = mesh_.data_and_context()});
    } else {
      parallel::DDPOptions options = run.ddp;
      options.group = mesh_.data_and_context();
      ddp_.emplace(*block_, options);
    }
    params_ = fsdp_ ? fsdp_->parameters() : block_->parameters();
    if (run.param_groups) {
      const auto groups = optim::weight_decay_groups(*block_, kGroupDecay);
      opt_ = std::make_unique<optim::AdamW>(fsdp_ ? fsdp_->param_groups(groups) : groups, kAdamW);
    } else {
      opt_ = std::make_unique<optim::AdamW>(params_, kAdamW);
    }
  }
  int64_t experts() const { return run_.experts_per_rank * run_.shape.expert; }

  // Returns the norm clipping measured.
  std::vector<double> step(int step) {
    opt_->zero_grad(/*set_to_none=*/false);
    const Tensor x = share(whole_input(step, run_.shape.data), mesh_);
    const Tensor y = fsdp_ ? (*fsdp_)(x) : (*ddp_)(x);
    objective(*block_, y, share(whole_target(step, run_.shape.data), mesh_)).backward();
    std::vector<double> norms;  // as Reference::step measures them
    for (double p : {1.0, double(INFINITY)})
      norms.push_back(parallel::clip_grad_norm_(params_, INFINITY, p));
    norms.push_back(parallel::clip_grad_norm_(params_, kMaxNorm));
    opt_->step();
    return norms;
  }

  // Every parameter this rank holds (its experts only) equals one process's of that name.
  void check_equal(Reference& ref) {
    std::map<std::string, Tensor> whole;
    for (const auto& [name, t] : ref.block->named_parameters()) whole[name] = t;
    int64_t compared = 0;
    for (const auto& [name, t] : fsdp_ ? fsdp_->full_state_dict() : block_->named_parameters()) {
      const std::string& key = name;  // a lambda cannot capture a binding
      CAPTURE(key);
      REQUIRE(whole.contains(name));
      CHECK(close(t, whole.at(name)));
      ++compared;
    }
    CHECK(compared == 4 + int64_t(moe_->router().parameters().size()) +
                          moe_->local_experts() *
                              int64_t(moe_->expert(moe_->first_expert()).parameters().size()));
  }

  data::TrainingState state() {
    return {.model = fsdp_ ? &fsdp_->sharded_module() : block_.get(), .optimizer = opt_.get()};
  }
  parallel::DDPStats stats() const { return ddp_ ? ddp_->stats() : parallel::DDPStats{}; }
  const parallel::ProcessMesh& mesh() const { return mesh_; }

 private:
  ComposedRun run_;
  parallel::ProcessMesh mesh_;
  std::shared_ptr<parallel::ExpertParallelMoE> moe_;
  std::unique_ptr<Block> block_;
  std::optional<parallel::DistributedDataParallel> ddp_;
  std::optional<parallel::FullyShardedDataParallel> fsdp_;
  std::vector<Tensor> params_;
  std::unique_ptr<optim::AdamW> opt_;
};

// Trains the block on `run`'s mesh for 3 steps and compares every parameter, and each step's
// clipping norm, with one process.
parallel::DDPStats check_against_one_process(const ComposedRun& run) {
  Composed composed(run);
  Reference ref(composed.experts(), run.param_groups);
  for (int step = 0; step < 3; ++step) {
    ref.step(step, run.shape.data);
    const std::vector<double> norms = composed.step(step);
    for (size_t k = 0; k < norms.size(); ++k) {
      CAPTURE(k);  // the 1-, infinity and 2-norm
      CHECK(norms[k] == doctest::Approx(ref.norms[ref.norms.size() - 3 + k]).epsilon(1e-12));
    }
  }
  composed.check_equal(ref);
  return composed.stats();
}

// A tensor-parallel MLP (its second bias replicated over the tensor group) on one process and
// on the mesh, from the same seed.
std::shared_ptr<nn::Sequential> mlp(std::optional<dist::Group> tensor) {
  manual_seed(21);
  std::shared_ptr<nn::Module> fc1, fc2;
  if (tensor) {
    fc1 = std::make_shared<parallel::ColumnParallelLinear>(8, 12, *tensor);
    fc2 = std::make_shared<parallel::RowParallelLinear>(12, 6, *tensor);
  } else {
    fc1 = std::make_shared<nn::Linear>(8, 12);
    fc2 = std::make_shared<nn::Linear>(12, 6);
  }
  auto model = std::make_shared<nn::Sequential>(
      std::initializer_list<std::shared_ptr<nn::Module>>{fc1, nn::ReLU(), fc2});
  model->to(kFloat64);
  return model;
}

// FSDP over the data axis around tensor-parallel layers, 3 AdamW steps with clipping: each
// rank's slices equal one process's on the stacked batch.
void check_fsdp_around_tensor_parallelism(int tensor) {
  const int n = dist::world_size(), data = n / tensor;
  parallel::ProcessMesh mesh({.data = data, .tensor = tensor});
  auto reference = mlp(std::nullopt);
  auto model = mlp(mesh.tensor());
  parallel::FullyShardedDataParallel fsdp(*model, {.group = mesh.data()});
  optim::AdamW opt(fsdp.parameters(), kAdamW);
  optim::AdamW ref_opt(reference->parameters(), kAdamW);
  constexpr int64_t kRows = 3;
  for (int step = 0; step < 3; ++step) {
    const Tensor x = shared_randn({kRows * data, 8}, 300 + uint64_t(step));
    const Tensor y = shared_randn({kRows * data, 6}, 400 + uint64_t(step));
    opt.zero_grad();
    ref_opt.zero_grad();
    const int64_t first = kRows * mesh.data_rank();
    mse_loss(fsdp(x.narrow(0, first, kRows)), y.narrow(0, first, kRows)).backward();
    mse_loss((*reference)(x), y).backward();
    for (double p : {1.0, double(INFINITY)})
      CHECK(parallel::clip_grad_norm_(fsdp.parameters(), INFINITY, p) ==
            doctest::Approx(optim::clip_grad_norm_(reference->parameters(), INFINITY, p))
                .epsilon(1e-12));
    const double norm = parallel::clip_grad_norm_(fsdp.parameters(), kMaxNorm);
    CHECK(
        norm ==
        doctest::Approx(optim::clip_grad_norm_(reference->parameters(), kMaxNorm)).epsilon(1e-12));
    opt.step();
    ref_opt.step();
  }
  // fsdp.clip_grad_norm_ counts norms over the data group only, which misses the other tensor
  // slices: every rank raises, naming the call that works.
  CHECK_THROWS_WITH_AS(fsdp.clip_grad_norm_(kMaxNorm),
                       doctest::Contains("parallel::clip_grad_norm_(fsdp.parameters(), max_norm)"),
                       Error);
  const std::map<std::string, int> axes = {{"0.weight", 0}, {"0.bias", 0}, {"2.weight", 1}};
  const nn::NamedTensors whole = reference->state_dict();
  const nn::NamedTensors mine = fsdp.full_state_dict();
  REQUIRE(mine.size() == whole.size());
  for (size_t i = 0; i < mine.size(); ++i) {
    CAPTURE(mine[i].first);
    const auto axis = axes.find(mine[i].first);
    const Tensor expected = axis == axes.end()
                                ? whole[i].second
                                : weave_test::piece(whole[i].second, axis->second, mesh.tensor());
    CHECK(close(mine[i].second, expected));
  }
}

}  // namespace

TEST_SUITE("compose") {
  TEST_CASE("FSDP over data around tensor-parallel layers equals one process (FSDP x TP)") {
    const int n = dist::world_size();
    if (n % 2 != 0) return;
    check_fsdp_around_tensor_parallelism(2);
  }

  TEST_CASE("DDP over data with experts spread over ranks equals one process (DP x EP)") {
    const int n = dist::world_size();
    const int expert = n % 2 == 0 ? 2 : n;
    check_against_one_process({.shape = {.data = n, .expert = expert}});
    if (n % 4 == 0) check_against_one_process({.shape = {.data = n, .expert = 4}});
  }

  TEST_CASE("DDP over data x context around ring attention equals one process (DP x CP)") {
    const int n = dist::world_size();
    if (n % 2 != 0) return;
    check_against_one_process({.shape = {.data = n / 2, .context = 2}});
  }

  TEST_CASE("context parallelism and experts spread over data x context (CP x EP)") {
    const int n = dist::world_size();
    if (n % 2 != 0) return;
    check_against_one_process({.shape = {.data = n / 2, .context = 2, .expert = 2}});
    if (n % 4 == 0)
      check_against_one_process({.shape = {.data = n / 2, .context = 2, .expert = 4}});
  }

  TEST_CASE("FSDP over data x context: experts sharded apart, ring attention (FSDP x EP, x CP)") {
    const int n = dist::world_size();
    const int expert = n % 2 == 0 ? 2 : n;
    check_against_one_process({.shape = {.data = n, .expert = expert}, .fully_sharded = true});
    if (n % 2 != 0) return;
    check_against_one_process({.shape = {.data = n / 2, .context = 2}, .fully_sharded = true});
    check_against_one_process(
        {.shape = {.data = n / 2, .context = 2, .expert = 2}, .fully_sharded = true});
  }

  TEST_CASE("parameter groups under FSDP x EP and DDP x EP equal one process's groups") {
    const int n = dist::world_size();
    const int expert = n % 2 == 0 ? 2 : n;
    // Each expert shard of the weight matrices decays, whichever rank holds it.
    check_against_one_process(
        {.shape = {.data = n, .expert = expert}, .fully_sharded = true, .param_groups = true});
    check_against_one_process({.shape = {.data = n, .expert = expert}, .param_groups = true});
    if (n % 4 == 0)
      check_against_one_process(
          {.shape = {.data = n, .expert = 4}, .fully_sharded = true, .param_groups = true});
  }

  TEST_CASE("a save of DP 2 x EP 2 loads on 1 rank, at EP 4 and as FSDP 2 x EP 2, exactly") {
    if (dist::world_size() != 4) return;  // the layouts need 4 ranks (CTest runs it at 4)
    const std::string dir = test::shared_dir("experts");
    constexpr int kBefore = 2;
    Reference ref(4);
    for (int step = 0; step <= kBefore; ++step) ref.step(step, 4);
    {
      Composed saved({.shape = {.data = 4, .expert = 2}});
      for (int step = 0; step < kBefore; ++step) saved.step(step);
      parallel::save_sharded_checkpoint(dir, saved.state());
    }
    // Each layout loads, takes the next step, and equals one process after it.
    if (dist::rank() == 0) {
      Reference alone(4);
      data::TrainingState into = alone.state();
      parallel::load_sharded_checkpoint(dir, into, dist::split_group(dist::world(), {{0}}));
      alone.step(kBefore, 4);
      for (const auto& [name, t] : alone.block->named_parameters()) {
        const std::string& key = name;  // a lambda cannot capture a binding
        CAPTURE(key);
        const auto whole = ref.block->named_parameters();
        const auto at = std::find_if(whole.begin(), whole.end(),
                                     [&](const auto& entry) { return entry.first == key; });
        REQUIRE(at != whole.end());
        CHECK(close(t, at->second));
      }
    } else {
      dist::split_group(dist::world(), {{0}});
    }
    for (const ComposedRun& layout :
         {ComposedRun{.shape = {.data = 4, .expert = 4}, .experts_per_rank = 1},
          ComposedRun{.shape = {.data = 4, .expert = 2}, .fully_sharded = true}}) {
      CAPTURE(layout.shape.expert);
      CAPTURE(layout.fully_sharded);
      Composed resumed(layout);
      data::TrainingState into = resumed.state();
      parallel::load_sharded_checkpoint(dir, into);
      resumed.step(kBefore);
      resumed.check_equal(ref);
    }
    dist::barrier();
    if (dist::rank() == 0) std::filesystem::remove_all(dir);
  }

  TEST_CASE("the trace shows the experts' bucket all_reduces starting before backward ends") {
    const int n = dist::world_size();
    if (n % 4 != 0) return;  // an expert-data group of 2 ranks or more
    // Buckets of one parameter each: each launches the moment its gradient is in.
    Composed composed(
        {.shape = {.data = n, .expert = 2}, .ddp = {.first_bucket_mb = 1e-9, .bucket_mb = 1e-9}});
    composed.step(0);  // the first backward traces the bucket order
    const dist::Group& replicas = composed.mesh().group({parallel::Axis::ExpertData});
    const std::string expert_data = fmt::format("[{}]", fmt::join(replicas.ranks(), ", "));
    // A reduce starts when the group's worker thread runs it; with four ranks on two cores the
    // scheduler can hold that thread past one backward's end, so the overlap must show in one
    // of three traced steps (without it, it shows in none). Every rank runs all three: a rank
    // that stopped at its first overlap would leave the others waiting in the next step.
    bool overlapped = false;
    for (int step = 1; step <= 3; ++step) {
      trace::start((std::filesystem::temp_directory_path() /
                    fmt::format("weave_compose_trace_{}_{{rank}}.json", getpid()))
                       .string());
      composed.step(step);
      const std::string path = trace::stop();
      nlohmann::json events = nlohmann::json::parse(std::ifstream(path))["traceEvents"];
      std::filesystem::remove(path);
      double backward_end = 0, first_expert_reduce = INFINITY;
      int64_t expert_reduces = 0;
      for (const auto& e : events) {
        if (e["ph"] != "X") continue;
        if (e["cat"] == "backward")
          backward_end = std::max(backward_end, e["ts"].get<double>() + e["dur"].get<double>());
        if (e["cat"] == "collective" && e["name"] == "all_reduce" &&
            e["args"]["group"] == expert_data) {
          first_expert_reduce = std::min(first_expert_reduce, e["ts"].get<double>());
          ++expert_reduces;
        }
      }
      CHECK(expert_reduces == 8);  // 2 experts on this rank, each 2 weights and 2 biases
      overlapped = overlapped || first_expert_reduce < backward_end;
    }
    CHECK(overlapped);
  }

  TEST_CASE("DDP overlaps the experts' buckets with backward, apart from the dense ones") {
    const int n = dist::world_size();
    if (n % 2 != 0) return;
    // Buckets of one parameter each: every one launches the moment its gradient is in.
    const parallel::DDPStats stats = check_against_one_process(
        {.shape = {.data = n, .expert = 2}, .ddp = {.first_bucket_mb = 1e-9, .bucket_mb = 1e-9}});
    CHECK(stats.buckets >= 3);
    CHECK(stats.ready_before_first_launch >= 1);
    CHECK(stats.ready_before_first_launch < stats.parameters);
  }
}
