// Sharded checkpoints at 1-4 ranks: exact resume of data-parallel (DDP) and ZeRO runs, the
// gathered single file, generations, and all-or-nothing loads across the group.
#include <doctest/doctest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <regex>
#include <thread>

#include "helpers.h"
#include "weave/parallel/checkpoint/checkpoint_index.h"

using namespace weave;
using test::shared_dir;
using weave::test::error_of;

namespace {

std::shared_ptr<data::TensorDataset> toy_data() {
  Generator g(3);
  Tensor x = randn({48, 5}, {}, &g);
  return std::make_shared<data::TensorDataset>(x, argmax(matmul(x, randn({5, 3}, {}, &g)), 1));
}

std::shared_ptr<nn::Sequential> make_model() {
  manual_seed(0);
  return std::make_shared<nn::Sequential>(std::initializer_list<std::shared_ptr<nn::Module>>{
      std::make_shared<nn::Linear>(5, 12), nn::ReLU(), std::make_shared<nn::Linear>(12, 3)});
}

enum class Strategy { DDP_SGD, DDP, Zero };

// Trains `epochs` epochs (resuming from / saving to a sharded checkpoint when given); returns
// this rank's losses.
std::vector<float> train(Strategy strategy, int epochs, const std::string& resume_from,
                         const std::string& save_to, bool single_file = false, bool async = false) {
  auto model = make_model();
  parallel::DistributedDataParallel ddp(*model);
  std::unique_ptr<optim::Optimizer> adam;  // or SGD: the replicated optimizer
  std::unique_ptr<parallel::ZeroRedundancyOptimizer> zero;
  optim::Optimizer* optimizer = nullptr;
  if (strategy == Strategy::DDP_SGD) {
    adam = std::make_unique<optim::SGD>(model->parameters(),
                                        optim::SGDOptions{.lr = 0.05, .momentum = 0.9});
    optimizer = adam.get();
  } else if (strategy == Strategy::DDP) {
    adam = std::make_unique<optim::AdamW>(model->parameters(), optim::AdamWOptions{.lr = 0.02});
    optimizer = adam.get();
  } else {
    zero = std::make_unique<parallel::ZeroRedundancyOptimizer>(
        model->parameters(), [](std::vector<Tensor> shard) -> std::unique_ptr<optim::Optimizer> {
          return std::make_unique<optim::AdamW>(shard, optim::AdamWOptions{.lr = 0.02});
        });
    optimizer = &zero->shard_optimizer();
  }
  auto sampler = std::make_shared<parallel::DistributedSampler>(
      48, parallel::DistributedSamplerOptions{.shuffle = true, .seed = 9});
  data::DataLoader loader(toy_data(), {.batch_size = 6, .sampler = sampler});
  data::TrainingState state{.model = model.get(), .optimizer = optimizer, .loader = &loader};
  int first_epoch = 0;
  if (!resume_from.empty()) {
    parallel::load_sharded_checkpoint(resume_from, state);
    first_epoch = std::stoi(state.user.at("epoch"));
  }
  std::vector<float> losses;
  for (int e = first_epoch; e < first_epoch + epochs; ++e) {
    sampler->set_epoch(e);
    for (const auto& batch : loader) {
      Tensor loss = cross_entropy(ddp(batch.input), batch.target);
      if (zero) {
        zero->zero_grad();
      } else {
        adam->zero_grad();
      }
      loss.backward();
      if (zero) {
        zero->step();
      } else {
        adam->step();
      }
      losses.push_back(loss.item<float>());
    }
  }
  if (!save_to.empty()) {
    state.user["epoch"] = std::to_string(first_epoch + epochs);
    parallel::save_sharded_checkpoint(save_to, state, dist::world(),
                                      {.single_file = single_file, .async = async});
  }
  return losses;
}

}  // namespace

TEST_SUITE("sharded_checkpoint") {
  TEST_CASE("exact resume across ranks: DDP (SGD, AdamW) and ZeRO, per-rank files or one") {
    for (Strategy strategy : {Strategy::DDP_SGD, Strategy::DDP, Strategy::Zero})
      for (bool single : {false, true}) {
        const std::string name = strategy == Strategy::DDP_SGD ? "ddp+sgd"
                                 : strategy == Strategy::DDP   ? "ddp+adamw"
                                                               : "zero+adamw";
        CAPTURE(name);
        CAPTURE(single);
        const std::string dir = shared_dir("resume");
        const std::vector<float> straight = train(strategy, 4, "", "");
        std::vector<float> joined = train(strategy, 2, "", dir, single);
        const std::vector<float> second = train(strategy, 2, dir, "");
        joined.insert(joined.end(), second.begin(), second.end());
        CHECK(joined == straight);  // bit-identical
        if (dist::rank() == 0) std::filesystem::remove_all(dir);
      }
  }

  TEST_CASE("asynchronous saves resume exactly; the load commits the save still being written") {
    for (Strategy strategy : {Strategy::DDP, Strategy::Zero})
      for (bool single : {false, true}) {
        CAPTURE(int(strategy));
        CAPTURE(single);
        const std::string dir = shared_dir("async_resume");
        const std::vector<float> straight = train(strategy, 4, "", "");
        std::vector<float> joined = train(strategy, 2, "", dir, single, true);
        const std::vector<float> second = train(strategy, 2, dir, "");
        joined.insert(joined.end(), second.begin(), second.end());
        CHECK(joined == straight);  // bit-identical
        if (dist::rank() == 0) std::filesystem::remove_all(dir);
      }
  }

  TEST_CASE("an asynchronous save keeps the state of its call while training goes on") {
    const std::string dir = shared_dir("async");
    auto generation = [&] {
      dist::barrier();
      std::ifstream in(dir + "/index.json");
      const std::string text((std::istreambuf_iterator<char>(in)), {});
      const auto at = text.find("\"generation\": ");
      return std::stoi(text.substr(at + 14));
    };
    auto model = make_model();
    Tensor weight = model->parameters()[0];
    data::TrainingState state{.model = model.get()};
    auto set = [&](double value) {
      NoGradGuard no_grad;
      weight.fill_(value);
    };
    set(1.0);
    parallel::save_sharded_checkpoint(dir, state);
    set(2.0);
    parallel::save_sharded_checkpoint(dir, state, dist::world(), {.async = true});
    set(3.0);                  // training goes on: the save holds its own copy
    CHECK(generation() == 1);  // nothing committed before the next save or the wait
    parallel::save_sharded_checkpoint(dir, state, dist::world(), {.async = true});
    CHECK(generation() == 2);  // the next save committed the previous one first
    set(4.0);
    parallel::wait_for_checkpoint();
    CHECK(generation() == 3);
    auto fresh = make_model();
    data::TrainingState into{.model = fresh.get()};
    parallel::load_sharded_checkpoint(dir, into);
    CHECK(equal(fresh->parameters()[0], full(weight.shape(), 3.0)));
    parallel::wait_for_checkpoint();  // nothing pending: returns at once

    // A background write that fails: the wait raises on every rank, the last save stays.
    const int n = dist::world_size();
    if (dist::rank() == 0)
      std::filesystem::create_directories(
          fmt::format("{}/rank-{:05d}-of-{:05d}.g4.safetensors", dir, n - 1, n));
    dist::barrier();
    set(5.0);
    parallel::save_sharded_checkpoint(dir, state, dist::world(), {.async = true});
    const std::string error = error_of([] { parallel::wait_for_checkpoint(); });
    if (dist::rank() == n - 1)
      CHECK(error.find("rank-") != std::string::npos);
    else
      CHECK(error.find("another rank") != std::string::npos);
    CHECK(generation() == 3);
    parallel::load_sharded_checkpoint(dir, into);
    CHECK(equal(fresh->parameters()[0], full(weight.shape(), 3.0)));
    if (dist::rank() == 0) std::filesystem::remove_all(dir);
  }

  TEST_CASE("an asynchronous save commits in the background once written, with no further call") {
    const std::string dir = shared_dir("async_commit");
    auto model = make_model();
    data::TrainingState state{.model = model.get()};
    parallel::save_sharded_checkpoint(dir, state);  // generation 1
    model->parameters()[0].detach().fill_(5.0);
    parallel::save_sharded_checkpoint(dir, state, dist::world(), {.async = true});
    // From here on this thread calls nothing of weave until the index moves to generation 2:
    // only the save's own thread can commit it.
    bool committed = false;
    for (int i = 0; i < 400 && !committed; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
      try {
        committed = parallel::detail::read_checkpoint_index(dir).generation == 2;
      } catch (const Error&) {
      }
    }
    CHECK(committed);
    model->parameters()[0].detach().fill_(-1.0);  // training goes on
    dist::barrier();  // the training thread's collectives beside the commit's: no mix-up
    auto fresh = make_model();
    data::TrainingState into{.model = fresh.get()};
    parallel::load_sharded_checkpoint(dir, into);
    CHECK(equal(fresh->parameters()[0], full(fresh->parameters()[0].shape(), 5.0)));
    dist::barrier();
    if (dist::rank() == 0) std::filesystem::remove_all(dir);
  }

  TEST_CASE("a new save replaces the old generation only after its index is committed") {
    const std::string dir = shared_dir("generations");
    auto model = make_model();
    data::TrainingState state{.model = model.get()};
    parallel::save_sharded_checkpoint(dir, state);
    model->parameters()[0].detach().fill_(3.0);
    parallel::save_sharded_checkpoint(dir, state);
    dist::barrier();
    const int n = dist::world_size();
    std::vector<std::string> names;
    for (const auto& entry : std::filesystem::directory_iterator(dir))
      names.push_back(entry.path().filename().string());
    std::sort(names.begin(), names.end());
    std::vector<std::string> expected{".weave-save.lock", "index.json"};
    for (int r = 0; r < n; ++r)
      expected.push_back(fmt::format("rank-{:05d}-of-{:05d}.g2.safetensors", r, n));
    std::sort(expected.begin(), expected.end());
    CHECK(names == expected);
    auto fresh = make_model();
    data::TrainingState into{.model = fresh.get()};
    parallel::load_sharded_checkpoint(dir, into);
    CHECK(equal(fresh->parameters()[0], full(fresh->parameters()[0].shape(), 3.0)));
    dist::barrier();
    if (dist::rank() == 0) std::filesystem::remove_all(dir);
  }

  TEST_CASE("a save after the last generation an int64 numbers raises; the checkpoint stays") {
    const std::string dir = shared_dir("last_generation");
    auto model = make_model();
    data::TrainingState state{.model = model.get()};
    parallel::save_sharded_checkpoint(dir, state);
    dist::barrier();
    const int64_t last = std::numeric_limits<int64_t>::max();
    if (dist::rank() == 0) {  // the same save, renumbered as the last generation
      parallel::detail::CheckpointIndex index = parallel::detail::read_checkpoint_index(dir);
      for (std::string& file : index.files) {
        const std::string renamed =
            std::regex_replace(file, std::regex(R"(\.g1\.)"), fmt::format(".g{}.", last));
        std::filesystem::rename(dir + "/" + file, dir + "/" + renamed);
        file = renamed;
      }
      index.generation = last;
      std::ofstream(dir + "/index.json") << index.dump();
    }
    dist::barrier();
    model->parameters()[0].detach().fill_(5.0);
    const std::string error = error_of([&] { parallel::save_sharded_checkpoint(dir, state); });
    CHECK_MESSAGE(error.find(dist::rank() == 0 ? "the last an int64 can number"
                                               : "failed to prepare the checkpoint directory") !=
                      std::string::npos,
                  error);
    auto fresh = make_model();
    data::TrainingState into{.model = fresh.get()};
    parallel::load_sharded_checkpoint(dir, into);
    CHECK(equal(fresh->parameters()[0], make_model()->parameters()[0]));
    dist::barrier();
    if (dist::rank() == 0) std::filesystem::remove_all(dir);
  }

  TEST_CASE("a save touches only its own files, and cleans up after killed saves") {
    const std::string dir = shared_dir("own_files");
    auto model = make_model();
    data::TrainingState state{.model = model.get()};
    parallel::save_sharded_checkpoint(dir, state);
    dist::barrier();
    // The user's files that look like ours, and temporaries that killed saves left behind.
    const std::vector<std::string> users = {"rank-mine.safetensors", "all-best.safetensors",
                                            "rank-00000-of-00001.safetensors", "notes.tmp-abcdef"};
    const std::vector<std::string> leftovers = {"rank-00000-of-00002.g7.safetensors.tmp-Ab12Cd",
                                                "index.json.tmp-x9Y8z7",
                                                "all-00004-ranks.g3.safetensors.tmp-qwerty"};
    if (dist::rank() == 0)
      for (const auto& name : users) std::ofstream(dir + "/" + name) << "mine";
    if (dist::rank() == dist::world_size() - 1)
      for (const auto& name : leftovers) std::ofstream(dir + "/" + name) << "partial";
    dist::barrier();
    parallel::save_sharded_checkpoint(dir, state);
    dist::barrier();
    for (const auto& name : users) CHECK_MESSAGE(std::filesystem::exists(dir + "/" + name), name);
    for (const auto& name : leftovers)
      CHECK_MESSAGE(!std::filesystem::exists(dir + "/" + name), name);
    dist::barrier();
    if (dist::rank() == 0) std::filesystem::remove_all(dir);
  }

  TEST_CASE("ranks that name different directories raise on every rank; the old save stays") {
    if (dist::world_size() < 2) return;
    const std::string dir = shared_dir("which_dir");
    auto model = make_model();
    data::TrainingState state{.model = model.get()};
    parallel::save_sharded_checkpoint(dir, state);
    const std::string mine = dist::rank() == 1 ? dir + "-elsewhere" : dir;
    const std::string error = error_of([&] { parallel::save_sharded_checkpoint(mine, state); });
    CHECK_MESSAGE(error.find("ranks disagree on the checkpoint directory") != std::string::npos,
                  error);
    auto fresh = make_model();
    fresh->parameters()[0].detach().fill_(0.0);  // only the load can bring the saved values back
    CHECK_FALSE(equal(fresh->parameters()[0], model->parameters()[0]));
    data::TrainingState into{.model = fresh.get()};
    parallel::load_sharded_checkpoint(dir, into);  // generation 1, whole
    CHECK(equal(fresh->parameters()[0], model->parameters()[0]));
    dist::barrier();
    if (dist::rank() == 0) std::filesystem::remove_all(dir);
  }

  TEST_CASE("two jobs saving into one directory: the one that comes second gets a clear error") {
    if (dist::world_size() < 2) return;
    const std::string dir = shared_dir("two_jobs");
    const int n = dist::world_size();
    std::vector<int> second_ranks;
    for (int r = 1; r < n; ++r) second_ranks.push_back(r);
    const dist::Group second = dist::new_group(second_ranks);
    auto model = make_model();
    data::TrainingState state{.model = model.get()};
    // Rank 0 stands for the first job, in the middle of its save: it holds the directory's lock
    // as a save does, from another process than the second job's ranks.
    std::optional<data::ExclusiveFileLock> first_job;
    if (dist::rank() == 0) {
      std::filesystem::create_directories(dir);
      std::string holder;
      first_job = data::ExclusiveFileLock::try_acquire(
          dir + "/.weave-save.lock", "process 4711 on node7, save 1f-g3", &holder);
      REQUIRE(first_job.has_value());
    }
    dist::barrier();
    if (dist::rank() != 0) {
      const std::string error =
          error_of([&] { parallel::save_sharded_checkpoint(dir, state, second); });
      if (second.rank() == 0) {
        CHECK_MESSAGE(
            error.find("another save into " + dir +
                       " is in progress (process 4711 on node7, save 1f-g3)") != std::string::npos,
            error);
        CHECK_MESSAGE(error.find("a checkpoint directory of its own") != std::string::npos, error);
      } else {
        CHECK_MESSAGE(error.find("failed to prepare the checkpoint directory") != std::string::npos,
                      error);
      }
    }
    dist::barrier();
    first_job.reset();  // the first job's save is over
    dist::barrier();
    if (dist::rank() != 0) {
      model->parameters()[0].detach().fill_(2.0);
      parallel::save_sharded_checkpoint(dir, state, second);
    }
    dist::barrier();
    auto fresh = make_model();
    data::TrainingState into{.model = fresh.get()};
    const auto report = parallel::load_sharded_checkpoint(dir, into);
    CHECK(report.saved_world_size == n - 1);
    CHECK(equal(fresh->parameters()[0], full(fresh->parameters()[0].shape(), 2.0)));
    dist::barrier();
    if (dist::rank() == 0) std::filesystem::remove_all(dir);
  }

  TEST_CASE("a file of another save under the same name is refused on every rank") {
    for (bool single_file : {false, true}) {
      CAPTURE(single_file);
      const std::string dir = shared_dir("mixed_saves"), other = shared_dir("mixed_saves_other");
      auto model = make_model();
      data::TrainingState state{.model = model.get()};
      parallel::save_sharded_checkpoint(dir, state, dist::world(), {.single_file = single_file});
      model->parameters()[0].detach().add_(1.0);  // the other save holds other values
      parallel::save_sharded_checkpoint(other, state, dist::world(), {.single_file = single_file});
      const std::string swapped =
          single_file ? fmt::format("all-{:05d}-ranks.g1.safetensors", dist::world_size())
                      : fmt::format("rank-{:05d}-of-{:05d}.g1.safetensors", dist::world_size() - 1,
                                    dist::world_size());
      dist::barrier();
      if (dist::rank() == 0)
        std::filesystem::copy_file(other + "/" + swapped, dir + "/" + swapped,
                                   std::filesystem::copy_options::overwrite_existing);
      dist::barrier();
      auto fresh = make_model();
      data::TrainingState into{.model = fresh.get()};
      const std::string error = error_of([&] { parallel::load_sharded_checkpoint(dir, into); });
      const bool named = error.find("belongs to another save") != std::string::npos ||
                         error.find("failed to plan its part") != std::string::npos;
      CHECK_MESSAGE(named, error);
      dist::barrier();
      if (dist::rank() == 0) {
        std::filesystem::remove_all(dir);
        std::filesystem::remove_all(other);
      }
    }
  }

  TEST_CASE("an empty directory path raises weave::Error on every rank, one rank's or all") {
    auto model = make_model();
    data::TrainingState state{.model = model.get()};
    CHECK_WEAVE_ERROR(parallel::save_sharded_checkpoint("", state), "save_sharded_checkpoint",
                      "found an empty path");
    if (dist::world_size() < 2) return;
    const std::string dir = shared_dir("empty_path");
    const std::string error =
        error_of([&] { parallel::save_sharded_checkpoint(dist::rank() == 1 ? "" : dir, state); });
    CHECK_MESSAGE(error.find("ranks disagree on the checkpoint directory") != std::string::npos,
                  error);
    dist::barrier();
    if (dist::rank() == 0) std::filesystem::remove_all(dir);
  }

  TEST_CASE("tensor parallel: each rank's shard comes back to that rank") {
    const std::string dir = shared_dir("tensor_parallel");
    const int n = dist::world_size();
    manual_seed(1);
    parallel::ColumnParallelLinear saved(4, 2 * n, dist::world());
    data::TrainingState state{.model = &saved};
    parallel::save_sharded_checkpoint(dir, state);
    manual_seed(2);
    parallel::ColumnParallelLinear fresh(4, 2 * n, dist::world());
    CHECK_FALSE(equal(fresh.weight, saved.weight));
    data::TrainingState into{.model = &fresh};
    parallel::load_sharded_checkpoint(dir, into);
    CHECK(equal(fresh.weight, saved.weight));
    CHECK(fresh.weight.shape() == Shape{2, 4});  // this rank's rows only
    dist::barrier();
    if (dist::rank() == 0) std::filesystem::remove_all(dir);
  }

  TEST_CASE("one rank's failed check fails the load everywhere, and nothing changes") {
    if (dist::world_size() < 2) return;
    const std::string dir = shared_dir("strict");
    auto model = make_model();
    data::TrainingState state{.model = model.get()};
    parallel::save_sharded_checkpoint(dir, state);
    // the last rank expects a different model
    const bool odd_one = dist::rank() == dist::world_size() - 1;
    manual_seed(5);
    std::shared_ptr<nn::Module> other =
        odd_one ? std::shared_ptr<nn::Module>(std::make_shared<nn::Linear>(5, 4))
                : std::shared_ptr<nn::Module>(std::make_shared<nn::Sequential>(
                      std::initializer_list<std::shared_ptr<nn::Module>>{
                          std::make_shared<nn::Linear>(5, 12), nn::ReLU(),
                          std::make_shared<nn::Linear>(12, 3)}));
    const Tensor before = other->parameters()[0].clone();
    data::TrainingState into{.model = other.get()};
    const std::string message = error_of([&] { parallel::load_sharded_checkpoint(dir, into); });
    if (odd_one)
      CHECK_MESSAGE(message.find("holds no 'model/weight'") != std::string::npos, message);
    else
      CHECK_MESSAGE(message.find("another rank of group") != std::string::npos, message);
    CHECK(equal(other->parameters()[0], before));
    // a checkpoint of another world size loads: every rank takes the one saved replica
    const std::string solo = shared_dir("solo");
    const dist::Group only_zero = dist::new_group({0});
    const Tensor saved_weight = model->parameters()[0].detach().clone();
    if (dist::rank() == 0) parallel::save_sharded_checkpoint(solo, state, only_zero);
    dist::barrier();
    model->parameters()[0].detach().fill_(7.0);
    const auto report = parallel::load_sharded_checkpoint(solo, state);
    CHECK(report.saved_world_size == 1);
    CHECK(equal(model->parameters()[0], saved_weight));
    dist::barrier();
    if (dist::rank() == 0) {
      std::filesystem::remove_all(dir);
      std::filesystem::remove_all(solo);
    }
  }
}
