#include "weave/parallel/compose/verify_layout.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include <cstring>
#include <map>
#include <set>

#include "weave/autograd/grad_mode.h"
#include "weave/nn/deferred.h"
#include "weave/nn/moe.h"
#include "weave/ops/ops.h"
#include "weave/parallel/checkpoint/pretrained.h"
#include "weave/parallel/compose/data_parallel.h"
#include "weave/parallel/compose/layout_seams.h"
#include "weave/parallel/core/agree.h"
#include "weave/parallel/core/placement.h"
#include "weave/parallel/core/replicas.h"
#include "weave/parallel/model_parallel/context_parallel.h"
#include "weave/parallel/model_parallel/pipeline.h"
#include "weave/tensor/checksum.h"

namespace weave::parallel {

namespace {

constexpr const char* kOp = "verify_layout";

nn::NamedTensors copies_of(const nn::NamedTensors& tensors) {
  nn::NamedTensors out;
  for (const auto& [name, t] : tensors) out.emplace_back(name, t.detach().clone());
  return out;
}

Tensor in_float64(const Tensor& t) {
  return t.defined() && is_floating(t.dtype()) ? t.to(kFloat64) : t;
}

Tensor default_loss(const Tensor& output, const Tensor& targets, const ProcessMesh*) {
  return cross_entropy(output.reshape({-1, output.size(-1)}), targets.reshape({-1}));
}

std::unique_ptr<optim::Optimizer> default_optimizer(nn::Module& model,
                                                    DataParallelWrapper* wrapper) {
  const std::vector<optim::ParamGroup> groups = optim::weight_decay_groups(model, 0.1);
  return std::make_unique<optim::AdamW>(wrapper ? wrapper->param_groups(groups) : groups,
                                        optim::AdamWOptions{.lr = 1e-2});
}

// Data rank d's block of rows, then its context rank's part of every sequence (zig-zag).
LayoutBatch default_shard(const LayoutBatch& whole, const ProcessMesh& mesh) {
  const int64_t rows = whole.targets.size(0), data = mesh.shape().data;
  WEAVE_CHECK(rows % data == 0, kOp,
              "the batch's {} rows do not divide among {} data ranks; hint: a batch of a "
              "multiple of {} rows, or a recipe.shard of your own",
              rows, data, data);
  const int64_t mine = rows / data, first = mesh.data_rank() * mine;
  const auto cut = [&](const Tensor& t) {
    if (!t.defined()) return t;
    const bool batched = t.dim() >= 2;  // [B, T, ...]; [T] positions are every row's
    const Tensor part = batched ? t.narrow(0, first, mine) : t;
    if (mesh.shape().context == 1) return part.contiguous();
    return shard_sequence(part, batched ? 1 : 0, mesh.context());
  };
  return {
      nn::Inputs(cut(whole.inputs.x), cut(whole.inputs.positions), cut(whole.inputs.document_ids)),
      cut(whole.targets)};
}

// The name prefixes of the mixtures of experts in `module`.
void find_mixtures(const nn::Module& module, const std::string& path,
                   std::vector<std::string>& out) {
  if (dynamic_cast<const nn::MoE*>(&module) != nullptr) out.push_back(path);
  for (const auto& [name, child] : module.named_children())
    find_mixtures(*child, path + name + ".", out);
}

// The whole model on this process: one step on the whole batch. Collective-free.
detail::StepRecord one_process(const LayoutRecipe& recipe, const LayoutBatch& batch,
                               std::vector<std::string>& mixtures) {
  std::shared_ptr<nn::Module> model;
  {
    nn::DeferredInit deferred(recipe.seed);
    model = recipe.model(nullptr);
  }
  WEAVE_CHECK(model != nullptr, kOp, "recipe.model(nullptr) gave no model for one process");
  model->to(kFloat64);
  nn::materialize(*model);
  find_mixtures(*model, "", mixtures);
  detail::StepRecord record;
  record.initial = copies_of(model->named_parameters());
  const std::unique_ptr<optim::Optimizer> opt = recipe.optimizer(*model, nullptr);
  opt->zero_grad();
  const Tensor loss = recipe.loss((*model)(batch.inputs), batch.targets, nullptr);
  loss.backward();
  record.loss = loss.item<double>();
  for (const auto& [name, p] : model->named_parameters())
    record.gradients.emplace_back(
        name, p.grad().defined() ? p.grad().detach().clone() : zeros_like(p.detach()));
  record.norm = optim::clip_grad_norm_(model->parameters(), recipe.max_norm);
  opt->step();
  record.after = copies_of(model->named_parameters());
  return record;
}

uint64_t mix(uint64_t z) {  // splitmix64's finalizer
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// A hash of the multiset of t's values: the sum of each element's hash, so that the ranks'
// shares add up to the whole batch's exactly when together they hold each element once.
uint64_t multiset_hash(const Tensor& t) {
  if (!t.defined()) return 0;
  const bool floating = is_floating(t.dtype());
  const Tensor c = t.detach().to(floating ? kFloat64 : kInt64).to(kCPU).contiguous();
  // Both are 8-byte elements: hash their bits.
  const auto* bits = static_cast<const unsigned char*>(c.data_ptr());
  uint64_t sum = 0;
  for (int64_t i = 0; i < c.numel(); ++i) {
    uint64_t element = 0;
    std::memcpy(&element, bits + 8 * i, sizeof element);
    sum += mix(element);
  }
  return sum;
}

// What the ranks' shares show wrong, the same on every rank ("" when nothing): peers (ranks of
// the same data and context coordinates) read other rows, or the data x context ranks' shares
// do not cover the batch once. Collective over the world.
std::string inputs_problem(const LayoutBatch& whole, const LayoutBatch& local,
                           const ProcessMesh& mesh) {
  const Tensor& x = local.inputs.x;
  const std::string mine =
      fmt::format("{} {} {} {} {:08x} {:08x} {} {} {} {}", mesh.data_rank(), mesh.context_rank(),
                  mesh.tensor_rank(), mesh.pipeline_rank(), x.defined() ? checksum(x) : 0,
                  local.targets.defined() ? checksum(local.targets) : 0, multiset_hash(x),
                  multiset_hash(local.targets), x.defined() ? x.numel() : 0,
                  local.targets.defined() ? local.targets.numel() : 0);
  const std::vector<std::string> all = detail::all_gather_bytes(mine, dist::world());
  // (data, context) -> the first rank there, and its inputs' and targets' checksums
  std::map<std::pair<int, int>, std::pair<int, std::pair<unsigned, unsigned>>> peers;
  uint64_t x_sum = 0, y_sum = 0;
  int64_t x_count = 0, y_count = 0;
  for (int r = 0; r < int(all.size()); ++r) {
    int d = 0, c = 0, t = 0, p = 0;
    unsigned long long xh = 0, yh = 0;
    long long xn = 0, yn = 0;
    unsigned x_crc = 0, y_crc = 0;
    std::sscanf(all[size_t(r)].c_str(), "%d %d %d %d %x %x %llu %llu %lld %lld", &d, &c, &t, &p,
                &x_crc, &y_crc, &xh, &yh, &xn, &yn);
    const std::pair<unsigned, unsigned> sums{x_crc, y_crc};
    const auto [seen, fresh] = peers.emplace(std::make_pair(d, c), std::make_pair(r, sums));
    if (!fresh && seen->second.second != sums)
      return fmt::format(
          "ranks {} and {} (data rank {}, context rank {}: tensor or pipeline "
          "peers, which read the same rows) read different inputs or targets",
          seen->second.first, r, d, c);
    if (t == 0 && p == 0) x_sum += xh, y_sum += yh, x_count += xn, y_count += yn;
  }
  const int64_t whole_count = whole.targets.numel();
  if (y_sum != multiset_hash(whole.targets) || x_sum != multiset_hash(whole.inputs.x) ||
      y_count != whole_count || x_count != whole.inputs.x.numel())
    return fmt::format(
        "the data x context ranks' shares hold {} target elements{} of the batch's {}: they do "
        "not cover it exactly once",
        y_count, y_count == whole_count ? " (other ones)" : "", whole_count);
  return "";
}

// The layout's side: this rank's part, wrapped, one step on its share, each step attempted on
// every rank so that one that raises ends the run on all of them alike.
class LayoutRun {
 public:
  LayoutRun(const ProcessMesh& mesh, const LayoutRecipe& recipe, detail::LayoutFacts& facts,
            std::set<std::string> names)
      : mesh_(mesh), recipe_(recipe), facts_(facts), names_(std::move(names)) {}

  void run(const LayoutBatch& batch) {
    if (!attempt("model", [&] { build(); }) || !attempt("wrapper", [&] { wrap(); }) ||
        !attempt("wrapper", [&] { facts_.layout.initial = whole_parameters(); }))
      return;
    facts_.have_initial = true;
    LayoutBatch local{nn::Inputs(Tensor()), Tensor()};
    if (!attempt("sampler", [&] { local = recipe_.shard(batch, mesh_); })) return;
    facts_.inputs_problem = inputs_problem(batch, local, mesh_);
    if (!attempt("optimizer", [&] {
          if (recipe_.averaging_optimizer) {
            averaging_step_ = recipe_.averaging_optimizer(*part_, mesh_);
          } else {
            optimizer_ = recipe_.optimizer(*part_, wrapper_.get());
            optimizer_->zero_grad();
          }
        }))
      return;
    Tensor loss;
    if (!train(local, loss) || !attempt("loss", [&] {
          facts_.layout.loss = replica_mean(loss, mesh_);
          facts_.have_loss = true;
        }))
      return;
    double norm = 0;
    if (averaging_step_) {  // the gradients are averaged inside the step: none to compare
      if (!attempt("optimizer step", [&] { norm = averaging_step_(); })) return;
    } else if (!attempt("backward", [&] { gradients(); }) || !attempt("clip", [&] {
                 norm = recipe_.clip(wrapper_->trained_parameters(), recipe_.max_norm);
               })) {
      return;
    }
    for (const std::string& text :
         detail::all_gather_bytes(fmt::format("{:.17g}", norm), dist::world()))
      facts_.layout_norms.push_back(std::stod(text));
    if ((!averaging_step_ && !attempt("optimizer step", [&] { optimizer_->step(); })) ||
        !attempt("optimizer step", [&] { facts_.layout.after = whole_parameters(); }))
      return;
    facts_.have_after = true;
  }

 private:
  // Runs `body` on this rank; false on every rank when it raised on any (the lowest such rank's
  // error kept as the step's).
  bool attempt(const char* step, const std::function<void()>& body) {
    std::string error;
    try {
      body();
    } catch (const std::exception& e) {
      error = e.what();
      if (error.empty()) error = "an exception without a message";
    }
    for (const std::string& raised : detail::all_gather_bytes(error, dist::world()))
      if (!raised.empty()) {
        facts_.raised_step = step;
        facts_.raised_message = raised;
        return false;
      }
    return true;
  }

  void build() {
    nn::DeferredInit deferred(recipe_.seed);
    part_ = recipe_.model(&mesh_);
    WEAVE_CHECK(part_ != nullptr, kOp, "recipe.model gave no model for rank {}", dist::rank());
    part_->to(kFloat64);
  }

  void wrap() {
    wrapper_ = recipe_.wrap(*part_, mesh_);
    WEAVE_CHECK(wrapper_ != nullptr, kOp, "recipe.wrap gave no wrapper on rank {}", dist::rank());
    // A pass-through leaves a deferred part to draw (DDP and FSDP draw their own).
    if (nn::has_deferred(wrapper_->sharded_module())) parallel::materialize(*part_);
    if (mesh_.shape().pipeline > 1)
      pipe_ = std::make_unique<Pipeline>(
          *wrapper_,
          PipelineOptions{.microbatches = recipe_.microbatches, .group = mesh_.pipeline()});
  }

  // Forward and backward of this rank's share (a pipeline's step on its stage); `loss` the
  // last stage's (undefined on the others).
  bool train(const LayoutBatch& local, Tensor& loss) {
    const auto objective = [&](const Tensor& output, const Tensor& targets) {
      return recipe_.loss(output, targets, &mesh_);
    };
    if (pipe_)
      return attempt("pipeline step",
                     [&] { loss = pipe_->train_step(local.inputs, local.targets, objective); });
    Tensor output;
    return attempt("forward", [&] { output = wrapper_->forward(local.inputs); }) &&
           attempt("loss", [&] { loss = objective(output, local.targets); }) &&
           attempt("backward", [&] { loss.backward(); });
  }

  nn::NamedTensors whole_parameters() {
    return gather_whole_state_dict(wrapper_->sharded_module(), dist::world(),
                                   [&](const std::string& name) { return names_.count(name) > 0; });
  }

  void gradients() {
    nn::Module& held = wrapper_->sharded_module();
    facts_.layout.gradients = gather_whole_gradients(held, dist::world());
    facts_.have_gradients = true;
    const detail::CopiesCompared copies =
        detail::compare_copies(held, dist::world(), [](const Tensor& p) { return p.grad(); });
    facts_.differing_copies = copies.parameter;
    facts_.copy_sides = copies.sides;
  }

  const ProcessMesh& mesh_;
  const LayoutRecipe& recipe_;
  detail::LayoutFacts& facts_;
  std::set<std::string> names_;  // one process's parameters
  std::shared_ptr<nn::Module> part_;
  std::unique_ptr<DataParallelWrapper> wrapper_;
  std::unique_ptr<Pipeline> pipe_;
  std::unique_ptr<optim::Optimizer> optimizer_;
  std::function<double()> averaging_step_;  // recipe.averaging_optimizer's
};

nlohmann::json to_json(const LayoutReport& r) {
  return {{"passed", r.passed},     {"largest", fmt::format("{:.17g}", r.largest_difference)},
          {"diverged", r.diverged}, {"difference", fmt::format("{:.17g}", r.difference)},
          {"seam", r.seam},         {"detail", r.detail},
          {"compared", r.compared}};
}

LayoutReport from_json(const nlohmann::json& j) {
  return {.passed = j.at("passed").get<bool>(),
          .largest_difference = std::stod(j.at("largest").get<std::string>()),
          .diverged = j.at("diverged").get<std::string>(),
          .difference = std::stod(j.at("difference").get<std::string>()),
          .seam = j.at("seam").get<std::string>(),
          .detail = j.at("detail").get<std::string>(),
          .compared = j.at("compared").get<int64_t>()};
}

}  // namespace

LayoutReport verify_layout(const ProcessMesh& mesh, const LayoutRecipe& given,
                           const LayoutBatch& batch) {
  WEAVE_CHECK(given.model != nullptr, kOp,
              "the recipe has no model; hint: recipe.model = [&](const ProcessMesh* mesh) {{ "
              "... }} builds the whole model for a null mesh, this rank's part otherwise");
  LayoutRecipe recipe = given;
  if (!recipe.wrap)
    recipe.wrap = [](nn::Module& part, const ProcessMesh& m) { return data_parallel(part, m); };
  if (!recipe.shard) recipe.shard = default_shard;
  if (!recipe.loss) recipe.loss = default_loss;
  if (!recipe.optimizer) recipe.optimizer = default_optimizer;
  if (!recipe.clip)
    recipe.clip = [](const std::vector<Tensor>& params, double max_norm) {
      return clip_grad_norm_(params, max_norm);
    };
  const dist::KeepAlive alive;
  const LayoutBatch whole{
      nn::Inputs(in_float64(batch.inputs.x), batch.inputs.positions, batch.inputs.document_ids),
      in_float64(batch.targets)};
  detail::LayoutFacts facts;
  facts.context = mesh.shape().context;
  facts.tolerance = recipe.tolerance;
  facts.reference = one_process(recipe, whole, facts.mixtures);
  std::set<std::string> names;
  for (const auto& [name, t] : facts.reference.initial) names.insert(name);
  LayoutRun(mesh, recipe, facts, std::move(names)).run(whole);
  const std::string report =
      dist::rank() == 0 ? to_json(detail::diagnose(facts)).dump() : std::string();
  return from_json(nlohmann::json::parse(detail::broadcast_bytes(report, 0, dist::world())));
}

}  // namespace weave::parallel
