// Kills a process that saves checkpoints in a loop (SIGKILL at random instants) and checks
// that the checkpoint on disk always loads and is whole: every tensor holds the version its
// metadata names, the old one or a newer one, never a mix.
//   weave_checkpoint_crash [kills = 100]
// Prints "kills=K loadable=L mid_write=M versions=A..B" and exits non-zero unless L == K.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <set>
#include <string>
#include <thread>

#include "weave/parallel/checkpoint/checkpoint_index.h"
#include "weave/weave.h"

using namespace weave;

namespace {

// 16 MB per save, so that a kill often lands while the file is being written.
nn::NamedTensors contents(int64_t version) {
  nn::NamedTensors tensors;
  for (int i = 0; i < 4; ++i)
    tensors.emplace_back(fmt::format("t{}", i), full({1 << 20}, double(version)));
  return tensors;
}

[[noreturn]] void save_forever(const std::string& path, int64_t first_version) {
  for (int64_t v = first_version;; ++v)
    data::save_safetensors(path, contents(v), {{"version", std::to_string(v)}});
}

// Runs body in a child process (a plain one: a world of one, no MPI) whose exit status is
// body's result (1 when it raised, with the message printed); returns the child's pid.
pid_t in_child(const std::function<int()>& body) {
  const pid_t child = fork();
  if (child != 0) return child;
  int code = 1;
  {
    dist::InitGuard guard;
    try {
      code = body();
    } catch (const std::exception& e) {
      std::printf("%s\n", e.what());
    }
  }
  std::fflush(stdout);
  std::_Exit(code);
}

}  // namespace

// Sharded saves (a world of one) SIGKILLed at random instants leave temporaries behind; the
// next complete save removes every one of them, and the checkpoint loads.
//   weave_checkpoint_crash sharded [kills = 100]
// Prints "sharded kills=K left=L after_next_save=0 loadable=1".
int sharded_crash(int kills) {
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::temp_directory_path() / ("weave_sharded_crash_" + std::to_string(getpid()));
  fs::create_directories(dir);
  auto save_in_child = [&](bool forever) {
    const pid_t child = fork();
    if (child != 0) return child;
    dist::InitGuard guard;  // a plain process: a world of one, no MPI
    nn::Linear model(1024, 1024);
    data::TrainingState state{.model = &model};
    do parallel::save_sharded_checkpoint(dir.string(), state);
    while (forever);
    std::_Exit(0);
  };
  std::mt19937 rng(54321);
  for (int k = 0; k < kills; ++k) {
    const pid_t child = save_in_child(true);
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 300000));
    kill(child, SIGKILL);
    waitpid(child, nullptr, 0);
  }
  auto temporaries = [&] {
    int n = 0;
    for (const auto& entry : fs::directory_iterator(dir))
      n += entry.path().filename().string().find(".tmp-") != std::string::npos;
    return n;
  };
  const int left = temporaries();
  int status = 0;
  waitpid(save_in_child(false), &status, 0);
  const int after = temporaries();
  int loadable = 0;
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
    dist::InitGuard guard;
    nn::Linear model(1024, 1024);
    data::TrainingState state{.model = &model};
    try {
      parallel::load_sharded_checkpoint(dir.string(), state);
      loadable = 1;
    } catch (const std::exception& e) {
      std::printf("the checkpoint does not load: %s\n", e.what());
    }
  }
  fs::remove_all(dir);
  std::printf("sharded kills=%d left=%d after_next_save=%d loadable=%d\n", kills, left, after,
              loadable);
  return after == 0 && loadable == 1 ? 0 : 1;
}

// Asynchronous sharded saves SIGKILLed at random instants: a process saves in a loop with
// {.async = true}, overwriting its parameters with -1 right after each call (training goes on
// while the background thread writes). After every kill the checkpoint must load, hold one
// saved version in every parameter (never the -1 of the training that followed), and never go
// back to an older version.
//   weave_checkpoint_crash async [kills = 50]
// Then one save that nothing follows, killed once it committed in the background: that save
// must load. Prints "async kills=K loadable=L mid_write=M versions=A..B after_commit=kept".
int async_crash(int kills) {
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::temp_directory_path() / ("weave_async_crash_" + std::to_string(getpid()));
  fs::create_directories(dir);
  auto fill = [](nn::Module& model, double value) {
    NoGradGuard no_grad;
    for (Tensor& p : model.parameters()) p.fill_(value);
  };
  auto save_from = [&](int64_t first, bool forever) {
    return in_child([&, first, forever] {
      nn::Linear model(1024, 1024);
      data::TrainingState state{.model = &model};
      for (int64_t v = first;; ++v) {
        fill(model, double(v));
        state.user["version"] = std::to_string(v);
        parallel::save_sharded_checkpoint(dir.string(), state, dist::world(), {.async = forever});
        fill(model, -1.0);  // the training that goes on while the save is written
        if (!forever) return 0;
      }
    });
  };
  int status = 0;
  waitpid(save_from(0, false), &status, 0);  // generation 1: version 0, synchronous
  std::mt19937 rng(2468);
  int loadable = 0, mid_write = 0;
  int64_t version = 0, lowest = -1;
  for (int k = 0; k < kills; ++k) {
    const pid_t saver = save_from(version + 1, true);
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 200000));
    kill(saver, SIGKILL);
    waitpid(saver, nullptr, 0);
    for (const auto& entry : fs::directory_iterator(dir))
      mid_write += entry.path().filename().string().find(".tmp-") != std::string::npos;
    // The check runs in a child too (the parent forks the next saver and must stay plain).
    const fs::path seen = dir / "seen-version";
    waitpid(in_child([&] {
              nn::Linear model(1024, 1024);
              data::TrainingState state{.model = &model};
              parallel::load_sharded_checkpoint(dir.string(), state);
              const int64_t v = std::stoll(state.user.at("version"));
              bool whole = v >= version;
              for (const Tensor& p : model.parameters())
                whole = whole && equal(p, full(p.shape(), double(v)));
              std::ofstream(seen) << v;
              return whole ? 0 : 2;
            }),
            &status, 0);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
      ++loadable;
      std::ifstream(seen) >> version;
      if (lowest < 0) lowest = version;
    } else {
      std::printf("kill %d: the checkpoint does not load whole after version %lld\n", k,
                  (long long)version);
    }
  }
  // A save that nothing follows: it commits in the background once written, so a process
  // killed right after (it never calls weave again) leaves that very save loadable.
  const int64_t last = version + 1;
  const int64_t generation_before =
      parallel::detail::read_checkpoint_index(dir.string()).generation;
  const pid_t quiet = in_child([&] {
    nn::Linear model(1024, 1024);
    data::TrainingState state{.model = &model};
    fill(model, double(last));
    state.user["version"] = std::to_string(last);
    parallel::save_sharded_checkpoint(dir.string(), state, dist::world(), {.async = true});
    fill(model, -1.0);
    for (int i = 0; i < 400; ++i) {  // only the save's own thread can move the index
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
      if (parallel::detail::read_checkpoint_index(dir.string()).generation > generation_before)
        std::raise(SIGKILL);
    }
    return 3;  // never committed
  });
  waitpid(quiet, &status, 0);
  const bool killed = WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
  int64_t after_kill = -1;
  waitpid(in_child([&] {
            nn::Linear model(1024, 1024);
            data::TrainingState state{.model = &model};
            parallel::load_sharded_checkpoint(dir.string(), state);
            std::ofstream(dir / "seen-version") << state.user.at("version");
            return 0;
          }),
          &status, 0);
  std::ifstream(dir / "seen-version") >> after_kill;
  const bool kept = killed && after_kill == last;
  fs::remove_all(dir);
  std::printf("async kills=%d loadable=%d mid_write=%d versions=%lld..%lld after_commit=%s\n",
              kills, loadable, mid_write, (long long)lowest, (long long)version,
              kept ? "kept" : fmt::format("lost (version {} loads)", after_kill).c_str());
  return loadable == kills && kept ? 0 : 1;
}

// Hugging Face exports SIGKILLed at random instants, each over the export before it: a process
// exports in a loop, alternating two models (a small GPT-2, and the same with every weight
// halved) and three layouts (one file, 6 shards, 3 shards). After every kill the directory must
// load one of the two models whole: a mix of the two, model files of two exports side by side,
// or a load that raises is the failure.
//   weave_checkpoint_crash hf [kills = 30]
// Prints "hf kills=K whole=W raised=R mixed=M mid_export=E left=L" (E: kills that left a staged
// export behind, so landed while one was written; L: staging folders still there after one more
// export, which must sweep what the killed ones left).
int hf_crash(int kills) {
  namespace fs = std::filesystem;
  const fs::path root = fs::temp_directory_path() / ("weave_hf_crash_" + std::to_string(getpid()));
  const std::string dir = (root / "model").string();
  const models::GPT2Options options{.vocab = 512, .dim = 256, .layers = 4, .heads = 4};
  const auto model_of = [&](int64_t version) {
    manual_seed(7);
    auto model = std::make_shared<models::GPT2>(options);
    NoGradGuard no_grad;
    if (version % 2 == 1)
      for (Tensor& p : model->parameters()) p.mul_(0.5);
    return model;
  };
  uint64_t bytes = 0;
  for (const Tensor& p : model_of(0)->parameters()) bytes += uint64_t(p.numel()) * 4;
  const auto export_from = [&](int64_t first, bool forever) {
    return in_child([&, first, forever] {
      const std::shared_ptr<models::GPT2> versions[2] = {model_of(0), model_of(1)};
      for (int64_t v = first;; ++v) {
        const uint64_t shards[3] = {2 * bytes, bytes / 6, bytes / 3};
        data::hf::save_pretrained(*versions[v % 2], models::model_config(options), dir,
                                  {.max_shard_bytes = shards[v % 3]});
        if (!forever) return 0;
      }
    });
  };
  int status = 0;
  waitpid(export_from(0, false), &status, 0);
  std::mt19937 rng(97531);
  int whole = 0, raised = 0, mixed = 0;
  std::set<std::string> staged;  // every staging folder a kill left (the next export sweeps it)
  const auto staged_now = [&] {
    int found = 0;
    for (const auto& entry : fs::directory_iterator(root))
      if (entry.path().filename().string().starts_with(".model.staged-"))
        ++found, staged.insert(entry.path().filename().string());
    return found;
  };
  for (int k = 0; k < kills; ++k) {
    const pid_t exporter = export_from(k + 1, true);
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 400000));
    kill(exporter, SIGKILL);
    waitpid(exporter, nullptr, 0);
    staged_now();
    // 0: one model whole; 2: a mix; 1: the load raised.
    waitpid(in_child([&] {
              auto loaded = models::from_pretrained(dir);
              const bool single = fs::exists(fs::path(dir) / "model.safetensors");
              const bool index = fs::exists(fs::path(dir) / "model.safetensors.index.json");
              if (single == index) return 2;
              for (int64_t v : {0, 1}) {
                const auto expected = model_of(v)->named_parameters();
                const auto got = loaded->named_parameters();
                bool same = expected.size() == got.size();
                for (size_t i = 0; same && i < got.size(); ++i)
                  same = equal(got[i].second, expected[i].second);
                if (same) return 0;
              }
              return 2;
            }),
            &status, 0);
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 2;
    whole += code == 0, raised += code == 1, mixed += code == 2;
    if (code == 2) std::printf("kill %d: the directory holds a mix of two exports\n", k);
  }
  waitpid(export_from(0, false), &status, 0);
  const int left = staged_now();
  fs::remove_all(root);
  std::printf("hf kills=%d whole=%d raised=%d mixed=%d mid_export=%zu left=%d\n", kills, whole,
              raised, mixed, staged.size(), left);
  return whole == kills && left == 0 ? 0 : 1;
}

int main(int argc, char** argv) {
  set_num_threads(1);
  if (argc > 1 && std::string(argv[1]) == "sharded")
    return sharded_crash(argc > 2 ? std::atoi(argv[2]) : 100);
  if (argc > 1 && std::string(argv[1]) == "hf") return hf_crash(argc > 2 ? std::atoi(argv[2]) : 30);
  if (argc > 1 && std::string(argv[1]) == "async")
    return async_crash(argc > 2 ? std::atoi(argv[2]) : 50);
  const int kills = argc > 1 ? std::atoi(argv[1]) : 100;
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("weave_crash_" + std::to_string(getpid()));
  fs::create_directories(dir);
  const std::string path = (dir / "ckpt.safetensors").string();
  data::save_safetensors(path, contents(0), {{"version", "0"}});
  std::mt19937 rng(12345);
  int loadable = 0, mid_write = 0;
  int64_t version = 0, lowest = -1;
  for (int k = 0; k < kills; ++k) {
    const pid_t child = fork();
    if (child == 0) save_forever(path, version + 1);
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 120000));
    kill(child, SIGKILL);
    waitpid(child, nullptr, 0);
    for (const auto& entry : fs::directory_iterator(dir))
      if (entry.path().filename().string().find(".tmp-") != std::string::npos) {
        ++mid_write;  // killed while a temporary was open: the interesting case
        fs::remove(entry.path());
      }
    try {
      const auto file = data::load_safetensors(path);
      const int64_t v = std::stoll(file.metadata.at("version"));
      bool whole = file.tensors.size() == 4 && v >= version;
      for (const auto& [name, t] : file.tensors)
        whole = whole && equal(t, full({1 << 20}, double(v)));
      if (whole) {
        ++loadable;
        version = v;
        if (lowest < 0) lowest = v;
      } else {
        std::printf("kill %d: the checkpoint is not whole (version %lld)\n", k, (long long)v);
      }
    } catch (const std::exception& e) {
      std::printf("kill %d: the checkpoint does not load: %s\n", k, e.what());
    }
  }
  fs::remove_all(dir);
  std::printf("kills=%d loadable=%d mid_write=%d versions=%lld..%lld\n", kills, loadable, mid_write,
              (long long)lowest, (long long)version);
  return loadable == kills ? 0 : 1;
}
