#include <zlib.h>

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <set>

#include "helpers.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

using namespace weave;

namespace {

std::filesystem::path temp_dir() {
  auto dir = std::filesystem::temp_directory_path() / ("weave_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return dir;
}

void write_gz(const std::filesystem::path& path, const std::vector<unsigned char>& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  REQUIRE(f != nullptr);
  gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size()));
  gzclose(f);
}

std::vector<unsigned char> idx(unsigned char rank, std::vector<int> dims, int payload,
                               unsigned char fill = 0) {
  std::vector<unsigned char> b{0, 0, 8, rank};
  for (int d : dims) {
    b.push_back(static_cast<unsigned char>(d >> 24));
    b.push_back(static_cast<unsigned char>(d >> 16));
    b.push_back(static_cast<unsigned char>(d >> 8));
    b.push_back(static_cast<unsigned char>(d));
  }
  for (int i = 0; i < payload; ++i) b.push_back(static_cast<unsigned char>(fill + i));
  return b;
}

}  // namespace

TEST_SUITE("data") {
  TEST_CASE("a lock file is never opened through a link and must be the user's regular file") {
    namespace fs = std::filesystem;
    const fs::path dir = fs::temp_directory_path() / fmt::format("weave_lock_{}", ::getpid());
    fs::remove_all(dir);
    fs::create_directories(dir);
    const std::string victim = (dir / "victim").string(),
                      lock = (dir / ".weave-save.lock").string();
    std::ofstream(victim) << "precious";
    std::string holder;
    fs::create_symlink(victim, lock);  // planted by whoever can write into the directory
    CHECK_WEAVE_ERROR(data::ExclusiveFileLock::try_acquire(lock, "job", &holder), "lock",
                      "is a symbolic link");
    std::ifstream kept(victim);
    CHECK(std::string(std::istreambuf_iterator<char>(kept), {}) == "precious");
    fs::remove(lock);
    REQUIRE(::mkfifo(lock.c_str(), 0600) == 0);
    CHECK_WEAVE_ERROR(data::ExclusiveFileLock::try_acquire(lock, "job", &holder), "lock",
                      "found not a regular file");
    fs::remove(lock);
    if (::geteuid() == 0) {  // root can hand the file to another user
      std::ofstream(lock) << "";
      REQUIRE(::chown(lock.c_str(), 1, 1) == 0);
      CHECK_WEAVE_ERROR(data::ExclusiveFileLock::try_acquire(lock, "job", &holder), "lock",
                        "found a file owned by uid 1");
      fs::remove(lock);
    }
    CHECK(data::ExclusiveFileLock::try_acquire(lock, "job", &holder).has_value());
    fs::remove_all(dir);
  }

  TEST_CASE("DataLoader batches, shuffles reproducibly and drops the last batch on request") {
    auto dataset = std::make_shared<data::TensorDataset>(arange(10).reshape({10, 1}),
                                                         arange(10, {.dtype = kInt64}));
    data::DataLoader plain(dataset, {.batch_size = 4});
    CHECK(plain.size() == 3);
    std::vector<int64_t> sizes;
    for (const auto& batch : plain) {
      sizes.push_back(batch.input.size(0));
      CHECK(equal(batch.input.squeeze(1).to(kInt64), batch.target));
    }
    CHECK(sizes == std::vector<int64_t>{4, 4, 2});
    data::DataLoader dropping(dataset, {.batch_size = 4, .drop_last = true});
    CHECK(dropping.size() == 2);

    auto epoch_order = [&](data::DataLoader& loader) {
      std::vector<int64_t> order;
      for (const auto& batch : loader)
        for (int64_t v : batch.target.to_vector<int64_t>()) order.push_back(v);
      return order;
    };
    data::DataLoader s1(dataset, {.batch_size = 3, .shuffle = true, .seed = 7});
    data::DataLoader s2(dataset, {.batch_size = 3, .shuffle = true, .seed = 7});
    auto e1 = epoch_order(s1), e2 = epoch_order(s2);
    CHECK(e1 == e2);
    CHECK(std::set<int64_t>(e1.begin(), e1.end()).size() == 10);
    auto next = epoch_order(s1);
    CHECK(next != e1);  // a new permutation each epoch
    CHECK(epoch_order(s2) == next);
  }

  TEST_CASE("IDX reader: round trip and clear errors") {
    auto dir = temp_dir();
    write_gz(dir / "train-images-idx3-ubyte.gz", idx(3, {2, 3, 4}, 24));
    write_gz(dir / "train-labels-idx1-ubyte.gz", idx(1, {2}, 2, 3));
    auto split = data::load_fashion_mnist(dir.string(), true);
    CHECK(split.images.shape() == Shape{2, 3, 4});
    CHECK(split.images.dtype() == kUInt8);
    CHECK(split.images.to_vector<int64_t>()[23] == 23);
    CHECK(split.labels.to_vector<int64_t>() == std::vector<int64_t>{3, 4});

    CHECK_WEAVE_ERROR(data::load_fashion_mnist(dir.string(), false), "read_idx", "cannot open");
    write_gz(dir / "t10k-images-idx3-ubyte.gz", idx(3, {2, 3, 4}, 10));  // truncated
    write_gz(dir / "t10k-labels-idx1-ubyte.gz", idx(1, {2}, 2));
    CHECK_WEAVE_ERROR(data::load_fashion_mnist(dir.string(), false), "read_idx", "truncated");
    auto bad = idx(1, {2}, 2);
    bad[2] = 0x0d;  // float IDX, not unsigned bytes
    write_gz(dir / "bad.gz", bad);
    CHECK_WEAVE_ERROR(data::read_idx((dir / "bad.gz").string()), "read_idx", "magic");
    std::filesystem::remove_all(dir);
  }

  TEST_CASE("IDX reader: crafted files are clear errors, never a crash or a huge allocation") {
    auto bytes_of = [](std::initializer_list<unsigned> values) {
      return std::vector<unsigned char>(values.begin(), values.end());
    };
    auto read = [](const std::vector<unsigned char>& b) {
      return data::read_idx_bytes(b.data(), b.size(), "crafted");
    };
    CHECK_WEAVE_ERROR(read(bytes_of({0, 0})), "read_idx", "no complete IDX header");
    CHECK_WEAVE_ERROR(read(bytes_of({0, 0, 8, 0})), "read_idx", "magic");  // 0 dimensions
    CHECK_WEAVE_ERROR(read(bytes_of({0, 0, 8, 5})), "read_idx", "magic");  // 5 dimensions
    CHECK_WEAVE_ERROR(read(bytes_of({1, 0, 8, 1, 0, 0, 0, 1, 7})), "read_idx", "magic");
    CHECK_WEAVE_ERROR(read(bytes_of({0, 0, 8, 2, 0, 0, 0, 1, 0, 0})), "read_idx",
                      "inside its list of sizes");
    // sizes whose product wraps int64 (it once wrapped to a small allocation, then overflowed)
    CHECK_WEAVE_ERROR(read(bytes_of({0,   0,   8,   4,   255, 255, 255, 255, 255, 255,
                                     255, 255, 255, 255, 255, 255, 255, 255, 255, 255})),
                      "read_idx", "more data than any IDX dataset holds");
    // 60000 x 28 x 28 declared, 3 bytes present: an error, without a 47 MB allocation first
    CHECK_WEAVE_ERROR(
        read(bytes_of({0, 0, 8, 3, 0, 0, 0xea, 0x60, 0, 0, 0, 28, 0, 0, 0, 28, 1, 2, 3})),
        "read_idx", "declares 47040000 bytes");
    CHECK_WEAVE_ERROR(read(bytes_of({0, 0, 8, 1, 0, 0, 0, 2, 1, 2, 3})), "read_idx",
                      "more data than its header declares");
    Tensor ok = read(bytes_of({0, 0, 8, 2, 0, 0, 0, 2, 0, 0, 0, 1, 5, 6}));
    CHECK(ok.shape() == Shape{2, 1});
    CHECK(ok.to_vector<int64_t>() == std::vector<int64_t>{5, 6});
    // A dataset directory of empty splits is an error, not an empty training run.
    auto dir = temp_dir();
    write_gz(dir / "t10k-images-idx3-ubyte.gz", idx(3, {0, 28, 28}, 0));
    write_gz(dir / "t10k-labels-idx1-ubyte.gz", idx(1, {0}, 0));
    CHECK_WEAVE_ERROR(data::load_fashion_mnist(dir.string(), false), "fashion_mnist",
                      "do not form a dataset");
    std::filesystem::remove_all(dir);
  }

  TEST_CASE("the installed Fashion-MNIST, when present") {
    if (!std::filesystem::exists(std::string(data::kFashionMnistDir) +
                                 "/t10k-labels-idx1-ubyte.gz")) {
      MESSAGE("Fashion-MNIST not installed; skipping");
      return;
    }
    auto test = data::load_fashion_mnist(data::kFashionMnistDir, false);
    CHECK(test.images.shape() == Shape{10000, 28, 28});
    CHECK(test.labels.shape() == Shape{10000});
    // The test split is balanced: 1000 examples per class.
    Tensor counts = zeros({10}, {.dtype = kInt64});
    for (int64_t c = 0; c < 10; ++c)
      CHECK(sum(eq(test.labels, scalar_tensor(static_cast<double>(c), {.dtype = kInt64})))
                .item<int64_t>() == 1000);
  }

  TEST_CASE("DistributedSampler: every item once plus wrapped padding, epoch-seeded") {
    const int64_t n = 50;
    const int replicas = 4;
    auto shares = [&](int64_t epoch, parallel::DistributedSamplerOptions options) {
      std::vector<std::vector<int64_t>> all;
      for (int r = 0; r < replicas; ++r) {
        parallel::DistributedSampler sampler(n, replicas, r, options);
        sampler.set_epoch(epoch);
        all.push_back(sampler.indices());
        CHECK(int64_t(all.back().size()) == sampler.size());
      }
      return all;
    };
    auto epoch3 = shares(3, {.seed = 7});
    std::multiset<int64_t> seen;
    for (const auto& share : epoch3) {
      CHECK(share.size() == 13);  // ceil(50 / 4)
      seen.insert(share.begin(), share.end());
    }
    CHECK(seen.size() == 52);
    for (int64_t i = 0; i < n; ++i) CHECK(seen.count(i) >= 1);
    // The two padded positions repeat the first two of the epoch's permutation: rank 2 and 3
    // take positions 50 and 51, which wrap to positions 0 and 1 (ranks 0 and 1's first items).
    CHECK(epoch3[2].back() == epoch3[0].front());
    CHECK(epoch3[3].back() == epoch3[1].front());
    CHECK(shares(3, {.seed = 7}) == epoch3);  // the same epoch, the same order
    CHECK(shares(4, {.seed = 7}) != epoch3);  // another epoch, another order
    // Without shuffle, rank r takes r, r + 4, ...
    auto plain = shares(0, {.shuffle = false});
    CHECK(plain[1][0] == 1);
    CHECK(plain[1][1] == 5);
    // drop_last: 12 each, no repeats, the tail of the permutation dropped.
    std::set<int64_t> kept;
    for (const auto& share : shares(3, {.seed = 7, .drop_last = true})) {
      CHECK(share.size() == 12);
      kept.insert(share.begin(), share.end());
    }
    CHECK(kept.size() == 48);
    // A DataLoader draws its batches from the sampler, a new epoch each set_epoch.
    auto dataset = std::make_shared<data::TensorDataset>(arange(double(n), {.dtype = kInt64}),
                                                         zeros({n}, {.dtype = kInt64}));
    auto sampler = std::make_shared<parallel::DistributedSampler>(
        n, replicas, 1, parallel::DistributedSamplerOptions{.seed = 7});
    sampler->set_epoch(3);
    data::DataLoader loader(dataset, {.batch_size = 5, .sampler = sampler});
    CHECK(loader.size() == 3);
    std::vector<int64_t> loaded;
    for (const data::Example& batch : loader)
      for (int64_t v : batch.input.to_vector<int64_t>()) loaded.push_back(v);
    CHECK(loaded == epoch3[1]);
    CHECK_WEAVE_ERROR(parallel::DistributedSampler(n, 4, 4), "DistributedSampler", "out of range");
  }

  TEST_CASE("DistributedSampler warns once when a pass repeats the last pass's epoch") {
    const int64_t n = 12;
    auto dataset = std::make_shared<data::TensorDataset>(arange(double(n), {.dtype = kInt64}),
                                                         zeros({n}, {.dtype = kInt64}));
    auto make = [&](parallel::DistributedSamplerOptions options) {
      auto sampler = std::make_shared<parallel::DistributedSampler>(n, 2, 0, options);
      return std::make_pair(
          sampler, std::make_shared<data::DataLoader>(
                       dataset, data::DataLoaderOptions{.batch_size = 3, .sampler = sampler}));
    };
    auto pass = [](data::DataLoader& loader) {
      return test::stderr_of([&] {
        for (const data::Example& batch : loader) (void)batch;
      });
    };
    const std::string repeat = "a new pass over epoch";
    {  // set_epoch before every epoch: silent
      auto [sampler, loader] = make({.seed = 1});
      for (int64_t epoch = 0; epoch < 3; ++epoch) {
        sampler->set_epoch(epoch);
        CHECK(pass(*loader).empty());
      }
    }
    {  // never set_epoch: the second pass warns, naming the epoch, and only once
      auto [sampler, loader] = make({.seed = 1});
      CHECK(pass(*loader).empty());
      const std::string warning = pass(*loader);
      CHECK(warning.find(repeat + " 0") != std::string::npos);
      CHECK(warning.find("hint: call set_epoch(epoch) before each epoch") != std::string::npos);
      CHECK(pass(*loader).empty());
    }
    {  // no shuffle: one order is what was asked for
      auto [sampler, loader] = make({.shuffle = false});
      CHECK(pass(*loader).empty());
      CHECK(pass(*loader).empty());
    }
    {  // resumed after epoch 1's last batch: the finished epoch's number again warns, the next
       // one does not (and the state carries the drawn epoch; an older state text still loads)
      auto [sampler, loader] = make({.seed = 1});
      sampler->set_epoch(1);
      CHECK(pass(*loader).empty());
      const data::LoaderState saved = loader->state();
      CHECK(saved.sampler == "epoch 1 seed 1 drawn 1");
      auto [wrong_sampler, wrong] = make({.seed = 1});
      wrong->load_state(saved);
      wrong_sampler->set_epoch(1);
      CHECK(pass(*wrong).find(repeat + " 1") != std::string::npos);
      auto [right_sampler, right] = make({.seed = 1});
      right->load_state(saved);
      right_sampler->set_epoch(2);
      CHECK(pass(*right).empty());
      right_sampler->load_state("epoch 4 seed 1");
      CHECK(right_sampler->state() == "epoch 4 seed 1 drawn -1");
      CHECK_WEAVE_ERROR(right_sampler->load_state("epoch 4 seed 1 drawn -2"), "DistributedSampler",
                        "not a saved sampler state");
    }
  }

  TEST_CASE("contiguous partitions cover a dataset exactly once") {
    auto dataset = std::make_shared<data::TensorDataset>(arange(10.0, {.dtype = kInt64}),
                                                         zeros({10}, {.dtype = kInt64}));
    std::vector<int64_t> all;
    for (int r = 0; r < 3; ++r) {
      parallel::PartitionedDataset part(dataset, 3, r);
      CHECK(part.size() == (r == 0 ? 4 : 3));  // 10 = 4 + 3 + 3
      for (int64_t v : part.get_batch({0, part.size() - 1}).input.to_vector<int64_t>())
        all.push_back(v);
    }
    CHECK(all == std::vector<int64_t>{0, 3, 4, 6, 7, 9});
    CHECK(parallel::contiguous_range(2, 4, 3) == std::pair<int64_t, int64_t>{2, 2});
  }

  TEST_CASE("DataLoader with worker threads: the same batches, state and errors as without") {
    manual_seed(5);
    auto dataset = std::make_shared<data::TensorDataset>(randn({53, 3}), arange(53.0));
    auto batches = [&](int workers, int prefetch) {
      data::DataLoader loader(dataset, {.batch_size = 4,
                                        .shuffle = true,
                                        .seed = 9,
                                        .num_workers = workers,
                                        .prefetch = prefetch});
      std::vector<Tensor> seen;
      for (int epoch = 0; epoch < 3; ++epoch)
        for (const data::Example& batch : loader) seen.push_back(batch.target);
      return seen;
    };
    const std::vector<Tensor> plain = batches(0, 0);
    struct Setting {
      int workers, prefetch;  // named: clang before 16 cannot capture a structured binding
    };
    for (const Setting& setting : {Setting{1, 0}, Setting{2, 2}, Setting{3, 7}}) {
      CAPTURE(setting.workers);
      CAPTURE(setting.prefetch);
      const std::vector<Tensor> threaded = batches(setting.workers, setting.prefetch);
      REQUIRE(threaded.size() == plain.size());
      for (size_t i = 0; i < plain.size(); ++i) CHECK(equal(threaded[i], plain[i]));
    }
    // Stopped mid-epoch (batches loaded ahead are not counted), saved, resumed with workers.
    data::DataLoader first(dataset,
                           {.batch_size = 4, .shuffle = true, .seed = 9, .num_workers = 2});
    data::DataLoader::Iterator it = first.begin();
    for (int i = 0; i < 5; ++i) ++it, (void)*it;
    const data::LoaderState state = first.state();
    CHECK(state.position == 6);
    data::DataLoader second(dataset,
                            {.batch_size = 4, .shuffle = true, .seed = 9, .num_workers = 3});
    second.load_state(state);
    std::vector<Tensor> rest;
    for (const data::Example& batch : second) rest.push_back(batch.target);
    REQUIRE(rest.size() == 14 - 6);
    for (size_t i = 0; i < rest.size(); ++i) CHECK(equal(rest[i], plain[6 + i]));
    // A worker's exception is raised where the loop takes that batch, and not before.
    struct Failing : data::Dataset {
      int64_t size() const override { return 20; }
      data::Example get(int64_t index) const override {
        if (index == 13) throw Error("[test] example 13 is corrupt");
        return {full({2}, double(index)), full({1}, double(index))};
      }
    };
    data::DataLoader failing(std::make_shared<Failing>(),
                             {.batch_size = 2, .num_workers = 2, .prefetch = 4});
    int taken = 0;
    const std::string error = test::error_of([&] {
      for (const data::Example& batch : failing) {
        (void)batch;
        ++taken;
      }
    });
    CHECK(taken == 6);  // batch 6 holds examples 12 and 13
    CHECK(error == "[test] example 13 is corrupt");
    CHECK_WEAVE_ERROR(data::DataLoader(dataset, {.num_workers = -1}), "DataLoader", "num_workers");
    // Far more workers than threads the system gives: refused before any starts.
    CHECK_WEAVE_ERROR(data::DataLoader(dataset, {.num_workers = 100000}), "DataLoader",
                      "num_workers must be at most 1024");
  }

  TEST_CASE("MetricsLogger: one JSON object per record, the documented fields, none invented") {
    const std::string path =
        (std::filesystem::temp_directory_path() / ("weave_metrics_" + std::to_string(getpid())))
            .string();
    {
      data::MetricsLogger metrics({.path = path, .total_steps = 4, .progress = false});
      metrics.log_step({.step = 1, .loss = 2.5, .lr = 1e-3, .tokens = 512});
      metrics.log_step({.step = 2,  // no lr, no tokens; a group's worst memory
                        .loss = 2.25,
                        .grad_norm = 0.75,
                        .memory = MemoryPeaks{.tensor_peak = 3'000'000,
                                              .tensor_rank = 2,
                                              .resident_peak = 5'000'000,
                                              .resident_rank = 3}});
      metrics.log_eval(2, "heldout_loss", 2.4);
      metrics.log_values(2, "routing", {{"blocks.0.moe/max_load", 1.5}, {"moe/dropped", NAN}});
    }
    std::ifstream in(path);
    std::vector<nlohmann::json> records;
    for (std::string line; std::getline(in, line);) records.push_back(nlohmann::json::parse(line));
    REQUIRE(records.size() == 4);
    CHECK(records[3] ==
          nlohmann::json({{"kind", "routing"},
                          {"step", 2},
                          {"values", {{"blocks.0.moe/max_load", 1.5}, {"moe/dropped", "nan"}}}}));
    CHECK(records[0]["kind"] == "train");
    CHECK(records[0]["step"] == 1);
    CHECK(records[0]["loss"] == 2.5);
    CHECK(records[0]["lr"] == 1e-3);
    CHECK(records[0]["tokens_per_s"].get<double>() > 0);
    CHECK(records[0]["eta_s"].get<double>() >= 0);
    CHECK(records[0].contains("peak_mb"));
    CHECK(records[0]["resident_mb"].get<double>() > 0);  // this process's own
    CHECK_FALSE(records[0].contains("peak_rank"));
    CHECK(records[1]["peak_mb"] == 3.0);
    CHECK(records[1]["peak_rank"] == 2);
    CHECK(records[1]["resident_mb"] == 5.0);
    CHECK(records[1]["resident_rank"] == 3);
    CHECK_FALSE(records[0].contains("grad_norm"));
    CHECK(records[1]["grad_norm"] == 0.75);
    CHECK_FALSE(records[1].contains("lr"));
    CHECK_FALSE(records[1].contains("tokens_per_s"));
    CHECK(records[2] == nlohmann::json({{"kind", "eval"},
                                        {"step", 2},
                                        {"name", "heldout_loss"},
                                        {"value", 2.4},
                                        {"elapsed_s", records[2]["elapsed_s"]}}));
    std::filesystem::remove(path);
    {
      data::MetricsLogger quiet({.path = path, .enabled = false});  // another rank's
      quiet.log_step({.step = 1, .loss = 1.0});
    }
    CHECK_FALSE(std::filesystem::exists(path));
    CHECK_WEAVE_ERROR(data::MetricsLogger({.path = "/nonexistent/dir/m.jsonl"}), "MetricsLogger",
                      "cannot open");
  }

  TEST_CASE("MetricsLogger: a run killed and resumed leaves the uninterrupted run's records") {
    const auto temp = std::filesystem::temp_directory_path();
    const std::string pid = std::to_string(getpid());
    const std::string whole = (temp / ("weave_metrics_whole_" + pid)).string(),
                      resumed = (temp / ("weave_metrics_resumed_" + pid)).string();
    // Steps start + 1 .. stop of a 6-step run, an evaluation every 2 steps.
    auto run = [](const std::string& path, int64_t start, int64_t stop, bool replace = false) {
      data::MetricsLogger metrics({.path = path,
                                   .total_steps = 6,
                                   .start_step = start,
                                   .replace = replace,
                                   .progress = false});
      for (int64_t step = start + 1; step <= stop; ++step) {
        metrics.log_step({.step = step, .loss = 1.0 / double(step), .lr = 1e-3, .tokens = 8});
        if (step % 2 == 0) metrics.log_eval(step, "heldout_loss", 2.0 / double(step));
      }
    };
    // The records without what depends on the clock and on memory.
    auto records_of = [](const std::string& path) {
      std::ifstream in(path);
      std::vector<nlohmann::json> records;
      for (std::string line; std::getline(in, line);) {
        nlohmann::json record = nlohmann::json::parse(line);
        for (const char* timing : {"elapsed_s", "eta_s", "tokens_per_s", "peak_mb", "resident_mb"})
          record.erase(timing);
        records.push_back(record);
      }
      return records;
    };
    run(whole, 0, 6);
    run(resumed, 0, 5);  // killed after step 5; the last checkpoint was at step 2
    { std::ofstream(resumed, std::ios::app) << "{\"kind\": \"tra"; }  // a line cut by the kill
    run(resumed, 2, 4);  // resumed at 2, killed after 4 (a checkpoint at 4)
    run(resumed, 4, 6);
    const std::vector<nlohmann::json> expected = records_of(whole);
    REQUIRE(expected.size() == 9);  // 6 steps, 3 evaluations
    CHECK(records_of(resumed) == expected);
    run(resumed, 4, 6, /*replace=*/true);  // asked to: only this run's records
    CHECK(records_of(resumed).size() == 3);
    std::filesystem::remove(whole);
    std::filesystem::remove(resumed);
  }

  TEST_CASE("MetricsLogger: a diverged loss shows, a full disk and a bad name raise") {
    const std::string path =
        (std::filesystem::temp_directory_path() / ("weave_metrics_nan_" + std::to_string(getpid())))
            .string();
    std::string progress;
    {
      data::MetricsLogger metrics({.path = path, .total_steps = 4});
      progress = test::stderr_of([&] {
        metrics.log_step({.step = 1, .loss = NAN, .grad_norm = INFINITY});
        metrics.log_eval(1, "heldout_loss", -INFINITY);
      });
      CHECK_WEAVE_ERROR(metrics.log_eval(2, "bad\xff", 1.0), "MetricsLogger", "valid UTF-8");
    }
    CHECK(progress.find("step 1/4 loss nan") != std::string::npos);
    CHECK(progress.find("grad_norm inf") != std::string::npos);
    std::ifstream in(path);
    std::vector<nlohmann::json> records;
    for (std::string line; std::getline(in, line);) records.push_back(nlohmann::json::parse(line));
    REQUIRE(records.size() == 2);  // the record with the bad name was not written
    CHECK(records[0]["loss"] == "nan");
    CHECK(records[0]["grad_norm"] == "inf");
    CHECK(records[1]["value"] == "-inf");
    std::filesystem::remove(path);
    if (std::filesystem::exists("/dev/full")) {  // every write fails with "no space"
      data::MetricsLogger full({.path = "/dev/full", .progress = false});
      CHECK_WEAVE_ERROR(full.log_step({.step = 1, .loss = 1.0}), "MetricsLogger",
                        "cannot write to /dev/full: No space left on device; this record is lost");
    }
  }

  TEST_CASE(
      "MetricsLogger: a second writer of the same file is refused, the first's records kept") {
    const std::string path = (std::filesystem::temp_directory_path() /
                              ("weave_metrics_two_" + std::to_string(getpid()) + ".jsonl"))
                                 .string();
    {
      data::MetricsLogger first({.path = path, .progress = false});
      first.log_step({.step = 1, .loss = 2.5});
      CHECK_WEAVE_ERROR(data::MetricsLogger({.path = path, .progress = false}), "MetricsLogger",
                        "is being written by another MetricsLogger");
      first.log_step({.step = 2, .loss = 2.0});
    }
    std::ifstream in(path);
    std::vector<nlohmann::json> records;
    for (std::string line; std::getline(in, line);) records.push_back(nlohmann::json::parse(line));
    REQUIRE(records.size() == 2);
    CHECK(records[0]["step"] == 1);
    CHECK(records[1]["step"] == 2);
    data::MetricsLogger again({.path = path, .progress = false});  // free once the first is gone
    std::filesystem::remove(path);
  }
}
