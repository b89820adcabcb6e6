// A training program for weave-run's tests: float64, ZeRO-1 over the world, a DistributedSampler
// with a fixed global batch (12, so any of 1-4 ranks splits it), a sharded checkpoint after every
// step, and resume_from_latest at the start. It can kill one of its ranks (SIGKILL) at a step on
// its first attempt, or hang there silently (rank 0 sleeps for ever, its peers wait in a
// collective), take MS milliseconds a step (silently: only weave's heartbeats show it is
// alive), and writes the final parameters (rank 0) as text.
//
//   elastic_train --steps N [--checkpoint DIR] [--out FILE] [--kill-at STEP] [--hang-at STEP]
//                 [--step-ms MS]
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "weave/weave.h"

using namespace weave;

int main(int argc, char** argv) {
  dist::init(dist::Backend::MPI);
  int64_t steps = 12, kill_at = -1, hang_at = -1, step_ms = 0;
  std::string checkpoint =
                  std::getenv("WEAVE_CHECKPOINT_DIR") ? std::getenv("WEAVE_CHECKPOINT_DIR") : "",
              out;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--steps") steps = std::stoll(value);
    if (flag == "--checkpoint") checkpoint = value;
    if (flag == "--out") out = value;
    if (flag == "--kill-at") kill_at = std::stoll(value);
    if (flag == "--hang-at") hang_at = std::stoll(value);
    if (flag == "--step-ms") step_ms = std::stoll(value);
  }
  const char* restart = std::getenv("WEAVE_RESTART_COUNT");
  const bool first_attempt = !restart || std::string(restart) == "0";
  constexpr int64_t kExamples = 48, kGlobalBatch = 12;

  Generator g(11);
  Tensor x = randn({kExamples, 5}, {.dtype = kFloat64}, &g);
  Tensor y = argmax(matmul(x, randn({5, 3}, {.dtype = kFloat64}, &g)), 1);
  manual_seed(0);
  nn::Sequential model(
      {std::make_shared<nn::Linear>(5, 8), nn::ReLU(), std::make_shared<nn::Linear>(8, 3)});
  model.to(kFloat64);
  parallel::ZeroRedundancyOptimizer zero(
      model.parameters(), [](std::vector<Tensor> shard) -> std::unique_ptr<optim::Optimizer> {
        return std::make_unique<optim::AdamW>(shard, optim::AdamWOptions{.lr = 0.01});
      });
  auto sampler = std::make_shared<parallel::DistributedSampler>(
      kExamples, parallel::DistributedSamplerOptions{.shuffle = true, .seed = 3});
  data::DataLoader loader(std::make_shared<data::TensorDataset>(x, y),
                          {.batch_size = kGlobalBatch / dist::world_size(), .sampler = sampler});
  data::TrainingState state{
      .model = &model, .optimizer = &zero.shard_optimizer(), .loader = &loader};

  int64_t step = 0, epoch = 0;
  if (!checkpoint.empty() && parallel::resume_from_latest(checkpoint, state)) {
    step = std::stoll(state.user.at("step"));
    epoch = std::stoll(state.user.at("epoch"));
    if (dist::rank() == 0)
      std::printf("resumed at step %lld with %d ranks\n", static_cast<long long>(step),
                  dist::world_size());
  }
  // After a resume, begin() stands where the saved run stood.
  sampler->set_epoch(epoch);
  data::DataLoader::Iterator next = loader.begin();
  for (; step < steps; ++step) {
    if (first_attempt && step == hang_at && dist::rank() == 0)
      for (;;) ::pause();  // stuck outside weave's collectives, without a word
    std::this_thread::sleep_for(std::chrono::milliseconds(step_ms));
    const data::Example& batch = *next;
    zero.zero_grad();
    cross_entropy(model.forward(batch.input), batch.target).backward();
    zero.step();
    if (++next == loader.end()) {  // the epoch is over: the next step belongs to the next one
      sampler->set_epoch(++epoch);
      next = loader.begin();
    }
    if (first_attempt && step + 1 == kill_at && dist::rank() == dist::world_size() - 1)
      std::raise(SIGKILL);  // before this step's save: the job resumes from the one before
    if (!checkpoint.empty()) {
      state.user["step"] = std::to_string(step + 1);
      state.user["epoch"] = std::to_string(epoch);
      parallel::save_sharded_checkpoint(checkpoint, state);
    }
  }
  if (dist::rank() == 0 && !out.empty()) {
    FILE* file = std::fopen(out.c_str(), "w");
    for (const Tensor& p : model.parameters())
      for (double v : p.contiguous().to_vector<double>()) std::fprintf(file, "%.17g\n", v);
    std::fclose(file);
  }
  dist::finalize();
  return 0;
}
