// Resharding sharded checkpoints at 4 ranks: a run saved as tensor parallel 2 x data parallel 2
// with ZeRO-1 (AdamW, mid-epoch, float64) loads as data parallel 2 (ZeRO-1), on 1 rank and as
// tensor parallel 4. Independent truth: the state gathered with collectives (not files), and an
// uninterrupted run of each layout over the same global batches.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <optional>

#include "helpers.h"

using namespace weave;
using test::shared_dir;
namespace F = weave::dist::functional;

namespace {

constexpr int64_t kExamples = 64, kGlobalBatch = 8;

std::shared_ptr<data::TensorDataset> dataset() {
  Generator g(11);
  Tensor x = randn({kExamples, 5}, {.dtype = kFloat64}, &g);
  Tensor y = argmax(matmul(x, randn({5, 3}, {.dtype = kFloat64}, &g)), 1);
  return std::make_shared<data::TensorDataset>(x, y);
}

// One layout: the tensor- and data-parallel groups of this rank, and whether ZeRO-1 shards the
// optimizer over the data-parallel group.
struct Layout {
  dist::Group tp, dp;
  bool zero = false;
};

// A layout's training run: the same model code at every tensor-parallel size (the layers built
// from the unsharded initialization, so every layout starts from the same model).
struct Run {
  std::shared_ptr<nn::Sequential> model;
  std::unique_ptr<parallel::ZeroRedundancyOptimizer> zero;
  std::unique_ptr<optim::AdamW> adamw;
  std::shared_ptr<parallel::DistributedSampler> sampler;
  std::unique_ptr<data::DataLoader> loader;
  Layout layout;
  int64_t epoch = 0;

  explicit Run(Layout l) : layout(std::move(l)) {
    manual_seed(0);
    model = std::make_shared<nn::Sequential>(std::initializer_list<std::shared_ptr<nn::Module>>{
        std::make_shared<parallel::ColumnParallelLinear>(5, 8, layout.tp), nn::ReLU(),
        std::make_shared<parallel::RowParallelLinear>(8, 4, layout.tp), nn::ReLU(),
        std::make_shared<nn::Linear>(4, 3)});
    model->to(kFloat64);
    const optim::AdamWOptions options{.lr = 0.01, .weight_decay = 0.1};
    if (layout.zero) {
      zero = std::make_unique<parallel::ZeroRedundancyOptimizer>(
          model->parameters(),
          [options](std::vector<Tensor> shard) -> std::unique_ptr<optim::Optimizer> {
            return std::make_unique<optim::AdamW>(shard, options);
          },
          layout.dp);
    } else {
      adamw = std::make_unique<optim::AdamW>(model->parameters(), options);
    }
    sampler = std::make_shared<parallel::DistributedSampler>(
        kExamples, parallel::DistributedSamplerOptions{.shuffle = true, .seed = 4}, layout.dp);
    loader = std::make_unique<data::DataLoader>(
        dataset(),
        data::DataLoaderOptions{.batch_size = kGlobalBatch / layout.dp.size(), .sampler = sampler});
  }

  optim::Optimizer& optimizer() { return zero ? zero->shard_optimizer() : *adamw; }
  data::TrainingState state() {
    return {.model = model.get(), .optimizer = &optimizer(), .loader = loader.get()};
  }

  // `steps` optimizer steps, epochs rolling over; a later call goes on where this one stopped
  // (a loader's begin() would start the epoch anew).
  void train(int steps) {
    for (; steps > 0; --steps) {
      if (!next || *next == loader->end()) {
        if (next) ++epoch;
        sampler->set_epoch(epoch);
        next = loader->begin();  // after a load: where the saved run stood
      }
      const data::Example& batch = **next;
      Tensor loss = cross_entropy(model->forward(batch.input), batch.target);
      if (zero) {
        zero->zero_grad();
        loss.backward();
        zero->step();
      } else {
        adamw->zero_grad();
        loss.backward();  // one data-parallel replica: no averaging needed
        adamw->step();
      }
      ++*next;
    }
  }
  std::optional<data::DataLoader::Iterator> next;

  void save(const std::string& dir, const dist::Group& group) {
    data::TrainingState s = state();
    // The epoch the next step belongs to: the next one once this one's batches are used up.
    const bool epoch_over = next && *next == loader->end();
    s.user["epoch"] = std::to_string(epoch + (epoch_over ? 1 : 0));
    parallel::save_sharded_checkpoint(dir, s, group);
  }
  parallel::ShardedLoadReport load(const std::string& dir, const dist::Group& group) {
    data::TrainingState s = state();
    const auto report = parallel::load_sharded_checkpoint(dir, s, group);
    epoch = std::stoll(s.user.at("epoch"));
    return report;
  }

  // The whole model and optimizer state, gathered with collectives: "model/<name>" and
  // "<slot>/<name>" (unsharded), and "step".
  std::map<std::string, Tensor> gathered() {
    std::map<std::string, Tensor> out;
    const auto axes = parallel::split_axes(*model);
    auto whole = [&](const std::string& name, const Tensor& local) {
      auto it = axes.find(name);
      return it == axes.end() ? local.detach().clone()
                              : F::all_gather(local.detach(), it->second, layout.tp);
    };
    const nn::NamedTensors params = model->named_parameters();
    for (const auto& [name, p] : params) out["model/" + name] = whole(name, p);
    const optim::OptimizerState s = optimizer().state_dict();
    out["step"] = full({1}, s.scalars.at("step"), {.dtype = kFloat64});
    for (const auto& [key, t] : s.tensors) {
      const std::string slot = key.substr(0, key.rfind('.'));
      if (!zero) {
        const size_t k = std::stoul(key.substr(key.rfind('.') + 1));
        out[slot + "/" + params[k].first] = whole(params[k].first, t);
        continue;
      }
      // ZeRO: this rank's slice of the flattened parameters; gather them, then cut the members
      // (back to back in parameter order) and gather each over the tensor-parallel group.
      const Tensor flat = F::all_gather(t.detach(), 0, layout.dp);
      int64_t offset = 0;
      for (const auto& [name, p] : params) {
        out[slot + "/" + name] = whole(name, flat.narrow(0, offset, p.numel()).reshape(p.shape()));
        offset += p.numel();
      }
    }
    return out;
  }
};

void check_same(const std::map<std::string, Tensor>& a, const std::map<std::string, Tensor>& b,
                double tolerance) {
  REQUIRE(a.size() == b.size());
  for (const auto& entry : a) {  // not a structured binding: doctest's macros capture it
    const std::string& name = entry.first;
    const Tensor& t = entry.second;
    REQUIRE_MESSAGE(b.count(name), name);
    const Tensor& u = b.at(name);
    REQUIRE_MESSAGE(t.shape() == u.shape(), name);
    const double diff = max(abs(t - u)).item<double>();
    CHECK_MESSAGE(diff <= tolerance, name, " differs by ", diff);
  }
}

// A group of this rank alone (every rank creates every rank's: a collective step).
dist::Group own_group() {
  dist::Group mine;
  for (int k = 0; k < dist::world_size(); ++k) {
    dist::Group g = dist::new_group({k});
    if (k == dist::rank()) mine = g;
  }
  return mine;
}

// Every rank creates every group (a collective step); each keeps its own.
struct Groups {
  dist::Group self, pair01, solo0, world;
  Layout saved, dp2, single, tp4;
  Groups() {
    const int r = dist::rank();
    self = own_group();
    const dist::Group tp01 = dist::new_group({0, 1}), tp23 = dist::new_group({2, 3});
    const dist::Group dp02 = dist::new_group({0, 2}), dp13 = dist::new_group({1, 3});
    pair01 = tp01;
    solo0 = r == 0 ? self : dist::Group();
    world = dist::world();
    saved = {r < 2 ? tp01 : tp23, r % 2 == 0 ? dp02 : dp13, true};
    dp2 = {self, tp01, true};
    single = {self, self, false};
    tp4 = {world, self, false};
  }
};

}  // namespace

TEST_SUITE("reshard") {
  TEST_CASE("TP 2 x DP 2 with ZeRO-1, saved mid-epoch, loads as DP 2, on 1 rank and as TP 4") {
    if (dist::world_size() != 4) return;  // the layouts need 4 ranks (CTest runs it at 4)
    const std::string dir = shared_dir("tp2dp2");
    const int rank = dist::rank();
    const Groups groups;
    constexpr int kBefore = 5, kAfter = 20;  // 8 steps an epoch: saved in epoch 0, at step 5

    Run original(groups.saved);
    original.train(kBefore);
    original.save(dir, groups.world);
    const auto at_save = original.gathered();
    original.train(kAfter);
    const auto original_end = original.gathered();

    struct Case {
      const char* name;
      Layout layout;
      bool member;  // this rank takes part
      dist::Group group;
    };
    const Case cases[] = {{"DP 2 (ZeRO-1)", groups.dp2, rank < 2, groups.pair01},
                          {"1 rank", groups.single, rank == 0, groups.solo0},
                          {"TP 4", groups.tp4, true, groups.world}};
    for (const Case& c : cases) {
      if (!c.member) continue;
      const std::string layout = c.name;
      CAPTURE(layout);
      Run resumed(c.layout);
      const auto report = resumed.load(dir, c.group);
      CHECK(report.saved_world_size == 4);
      // bitwise: the same state, laid out anew
      check_same(resumed.gathered(), at_save, 0.0);
      CHECK(resumed.epoch == 0);
      resumed.train(kAfter);
      // the new layout run straight through, over the same global batches
      Run uninterrupted(c.layout);
      uninterrupted.train(kBefore + kAfter);
      const auto end = resumed.gathered();
      check_same(end, uninterrupted.gathered(), 1e-12);
      check_same(end, original_end, 1e-12);
    }
    // The parameters moved: the comparison is not between untouched initializations.
    CHECK(
        max(abs(original_end.at("model/4.weight") - at_save.at("model/4.weight"))).item<double>() >
        1e-3);
    dist::barrier();
    if (rank == 0) std::filesystem::remove_all(dir);
  }

  TEST_CASE("bad inputs raise on every rank and change nothing") {
    const int n = dist::world_size(), rank = dist::rank();
    if (n < 2) return;
    const std::string dir = shared_dir("bad_inputs");
    const dist::Group self = own_group();
    const Layout zero_over_world{self, dist::world(), true};
    Run saved(zero_over_world);
    saved.train(3);
    saved.save(dir, dist::world());

    Run target(zero_over_world);
    target.train(1);
    const auto before = target.gathered();
    auto unchanged = [&] { check_same(target.gathered(), before, 0.0); };
    auto load_error = [&](Run& run) {
      data::TrainingState s = run.state();
      return test::error_of([&] { parallel::load_sharded_checkpoint(dir, s); });
    };

    SUBCASE("a layout the shapes cannot divide into") {
      // n + 1 output features over n ranks: the layer itself refuses, on every rank.
      const std::string message =
          test::error_of([&] { parallel::ColumnParallelLinear layer(5, n + 1, dist::world()); });
      CHECK_MESSAGE(message.find("divide") != std::string::npos, message);
    }
    SUBCASE("a checkpoint of another model") {
      manual_seed(0);
      nn::Sequential other(std::initializer_list<std::shared_ptr<nn::Module>>{
          std::make_shared<parallel::ColumnParallelLinear>(5, 8, self), nn::ReLU(),
          std::make_shared<parallel::RowParallelLinear>(8, 4, self), nn::ReLU(),
          std::make_shared<nn::Linear>(4, 2)});  // 2 classes, not 3
      other.to(kFloat64);
      const Tensor kept = other.parameters().back().detach().clone();
      data::TrainingState s{.model = &other};
      const std::string message =
          test::error_of([&] { parallel::load_sharded_checkpoint(dir, s); });
      CHECK_MESSAGE(
          message.find("holds 'model/4.weight' with shape [3, 4], but this model's is [2, 4]") !=
              std::string::npos,
          message);
      CHECK(equal(other.parameters().back(), kept));
      // and one without the saved model's last layer: what it leaves over is refused
      manual_seed(0);
      nn::Sequential shorter(std::initializer_list<std::shared_ptr<nn::Module>>{
          std::make_shared<parallel::ColumnParallelLinear>(5, 8, self), nn::ReLU(),
          std::make_shared<parallel::RowParallelLinear>(8, 4, self)});
      shorter.to(kFloat64);
      const Tensor first = shorter.parameters()[0].detach().clone();
      data::TrainingState fewer{.model = &shorter};
      const std::string left_over =
          test::error_of([&] { parallel::load_sharded_checkpoint(dir, fewer); });
      CHECK_MESSAGE(left_over.find("holds 'model/4.bias', which nothing being restored on any "
                                   "rank takes") != std::string::npos,
                    left_over);
      CHECK(equal(shorter.parameters()[0], first));
    }
    SUBCASE("a missing shard") {
      dist::barrier();
      std::string missing;
      if (rank == 0)
        for (const auto& entry : std::filesystem::directory_iterator(dir))
          if (entry.path().filename().string().rfind(fmt::format("rank-{:05d}", n - 1), 0) == 0) {
            missing = entry.path().filename().string();
            std::filesystem::remove(entry.path());
          }
      dist::barrier();
      const std::string message = load_error(target);
      CHECK_MESSAGE(
          message.find(fmt::format("rank-{:05d}-of-{:05d}", n - 1, n)) != std::string::npos,
          message);
      unchanged();
    }
    SUBCASE("a checksum mismatch") {
      dist::barrier();
      // One byte of the last rank's data flipped (the file's last byte: its optimizer state).
      if (rank == 0)
        for (const auto& entry : std::filesystem::directory_iterator(dir))
          if (entry.path().filename().string().rfind(fmt::format("rank-{:05d}", n - 1), 0) == 0) {
            std::fstream file(entry.path(), std::ios::in | std::ios::out | std::ios::binary);
            file.seekg(-1, std::ios::end);
            const char byte = char(file.get() ^ 0x10);
            file.seekp(-1, std::ios::end);
            file.put(byte);
          }
      dist::barrier();
      const std::string message = load_error(target);
      if (rank == n - 1)
        CHECK_MESSAGE(message.find("fail their checksum") != std::string::npos, message);
      else
        CHECK_MESSAGE(message.find("another rank of group") != std::string::npos, message);
      unchanged();
    }
    dist::barrier();
    if (rank == 0) std::filesystem::remove_all(dir);
  }

  TEST_CASE("FSDP saved at N ranks loads on 1 rank without FSDP, and as FSDP over 2 ranks") {
    const int n = dist::world_size(), rank = dist::rank();
    if (n < 2) return;
    const std::string dir = shared_dir("fsdp");
    const dist::Group self = own_group();
    const dist::Group pair = dist::new_group({0, 1});
    Generator g(5);
    const Tensor x = randn({12, 5}, {.dtype = kFloat64}, &g);
    const Tensor y = argmax(matmul(x, randn({5, 3}, {.dtype = kFloat64}, &g)), 1);
    auto make_model = [] {
      manual_seed(0);
      auto model =
          std::make_shared<nn::Sequential>(std::initializer_list<std::shared_ptr<nn::Module>>{
              std::make_shared<nn::Linear>(5, 8), nn::ReLU(), std::make_shared<nn::Linear>(8, 3)});
      model->to(kFloat64);
      return model;
    };
    const optim::AdamWOptions options{.lr = 0.01, .weight_decay = 0.1};
    // The global batch of 12, split over the group's ranks.
    auto my_rows = [&](const dist::Group& group, const Tensor& t) {
      const int64_t rows = 12 / group.size();
      return t.narrow(0, group.rank() * rows, rows);
    };
    auto fsdp_steps = [&](parallel::FullyShardedDataParallel& fsdp, optim::AdamW& adamw,
                          const dist::Group& group, int steps) {
      for (int s = 0; s < steps; ++s) {
        adamw.zero_grad();
        cross_entropy(fsdp(my_rows(group, x)), my_rows(group, y)).backward();
        adamw.step();
      }
    };

    auto model = make_model();
    parallel::FullyShardedDataParallel fsdp(*model);
    optim::AdamW adamw(fsdp.parameters(), options);
    fsdp_steps(fsdp, adamw, dist::world(), 3);
    data::TrainingState saved{.model = &fsdp.sharded_module(), .optimizer = &adamw};
    parallel::save_sharded_checkpoint(dir, saved);
    fsdp_steps(fsdp, adamw, dist::world(), 3);
    const nn::NamedTensors reference = fsdp.full_state_dict();
    auto check_against_reference = [&](const nn::NamedTensors& state) {
      REQUIRE(state.size() == reference.size());
      for (size_t i = 0; i < state.size(); ++i) {
        CAPTURE(state[i].first);
        CHECK(max(abs(state[i].second - reference[i].second)).item<double>() <= 1e-12);
      }
    };

    if (rank == 0) {  // one rank, no FSDP: the whole batch
      auto plain = make_model();
      optim::AdamW plain_adamw(plain->parameters(), options);
      data::TrainingState into{.model = plain.get(), .optimizer = &plain_adamw};
      parallel::load_sharded_checkpoint(dir, into, self);
      for (int s = 0; s < 3; ++s) {
        plain_adamw.zero_grad();
        cross_entropy(plain->forward(x), y).backward();
        plain_adamw.step();
      }
      check_against_reference(plain->state_dict());
    }
    // The model alone, on every rank (to export or evaluate it): the optimizer's state is left
    // in the files, and the model holds the saved step's values.
    {
      auto whole = make_model();
      data::TrainingState into{.model = whole.get()};
      parallel::load_sharded_checkpoint(dir, into, self);
      auto again = make_model();
      optim::AdamW again_adamw(again->parameters(), options);
      data::TrainingState both{.model = again.get(), .optimizer = &again_adamw};
      parallel::load_sharded_checkpoint(dir, both, self);
      const nn::NamedTensors got = whole->state_dict(), want = again->state_dict();
      REQUIRE(got.size() == want.size());
      for (size_t i = 0; i < got.size(); ++i) CHECK(equal(got[i].second, want[i].second));
    }
    if (n >= 3 && rank < 2) {  // FSDP over 2 ranks, its units regrouped into one
      auto two = make_model();
      parallel::FullyShardedDataParallel fsdp2(*two, {.unit_mb = 1, .group = pair});
      optim::AdamW adamw2(fsdp2.parameters(), options);
      data::TrainingState into{.model = &fsdp2.sharded_module(), .optimizer = &adamw2};
      parallel::load_sharded_checkpoint(dir, into, pair);
      fsdp_steps(fsdp2, adamw2, pair, 3);
      check_against_reference(fsdp2.full_state_dict());
    }
    dist::barrier();
    if (rank == 0) std::filesystem::remove_all(dir);
  }
}
