#include "weave/data/dataloader.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <numeric>
#include <sstream>
#include <system_error>
#include <thread>

#include "weave/autograd/grad_mode.h"

namespace weave::data {

Example Dataset::get_batch(const std::vector<int64_t>& indices) const {
  std::vector<Tensor> inputs, targets, positions, document_ids;
  for (int64_t i : indices) {
    Example e = get(i);
    inputs.push_back(e.input);
    targets.push_back(e.target);
    if (e.positions.defined()) positions.push_back(e.positions);
    if (e.document_ids.defined()) document_ids.push_back(e.document_ids);
  }
  const auto stacked = [&](const std::vector<Tensor>& parts, const char* what) {
    if (parts.empty()) return Tensor();
    WEAVE_CHECK(parts.size() == indices.size(), "Dataset",
                "some examples of a batch have {} and some do not", what);
    return stack(parts);
  };
  return {stack(inputs), stack(targets), stacked(positions, "positions"),
          stacked(document_ids, "document ids")};
}

std::vector<int64_t> Sampler::indices_from(int64_t consumed) {
  std::vector<int64_t> all = indices();
  all.erase(all.begin(), all.begin() + std::clamp<int64_t>(consumed, 0, int64_t(all.size())));
  return all;
}

TensorDataset::TensorDataset(Tensor inputs, Tensor targets)
    : inputs_(std::move(inputs)), targets_(std::move(targets)) {
  WEAVE_CHECK(inputs_.defined() && targets_.defined() && inputs_.dim() > 0 && targets_.dim() > 0 &&
                  inputs_.size(0) == targets_.size(0),
              "TensorDataset", "inputs and targets need the same first dimension, found {} and {}",
              inputs_.defined() ? inputs_.shape() : Shape{},
              targets_.defined() ? targets_.shape() : Shape{});
}

Example TensorDataset::get(int64_t index) const {
  WEAVE_CHECK(index >= 0 && index < size(), "TensorDataset", "index {} out of range [0, {})", index,
              size());
  return {inputs_.select(0, index), targets_.select(0, index)};
}

Example TensorDataset::get_batch(const std::vector<int64_t>& indices) const {
  Tensor idx = from_vector(indices, {}, inputs_.device());
  return {index_select(inputs_, 0, idx), index_select(targets_, 0, idx.to(targets_.device()))};
}

// Loader threads. Each task carries its batch's indices, copied when it is scheduled, so a new
// epoch's order never races a load; results are kept by (epoch, batch) and a new epoch drops
// the old one's.
struct DataLoader::Workers {
  struct Result {
    bool ready = false;
    Example example;
    std::exception_ptr error;
  };
  struct Task {
    int64_t epoch, batch;
    std::vector<int64_t> indices;
  };
  std::shared_ptr<const Dataset> dataset;
  std::mutex mutex;
  std::condition_variable work, done;
  std::deque<Task> queue;
  std::map<int64_t, Result> results;  // this epoch's batches, scheduled or loaded
  int64_t epoch = 0;
  bool stop = false;
  std::vector<std::thread> threads;

  void run() {
    for (;;) {
      Task task;
      {
        std::unique_lock lock(mutex);
        work.wait(lock, [&] { return stop || !queue.empty(); });
        if (stop) return;
        task = std::move(queue.front());
        queue.pop_front();
      }
      Result result{.ready = true, .example = {}, .error = nullptr};
      try {
        NoGradGuard no_grad;
        result.example = dataset->get_batch(task.indices);
      } catch (...) {
        result.error = std::current_exception();
      }
      std::lock_guard lock(mutex);
      auto slot = results.find(task.batch);
      if (task.epoch == epoch && slot != results.end()) slot->second = std::move(result);
      done.notify_all();
    }
  }
  void stop_and_join() {
    {
      std::lock_guard lock(mutex);
      stop = true;
    }
    work.notify_all();
    for (std::thread& t : threads) t.join();
    threads.clear();
  }
  // A new epoch: what was queued or loaded for the last one is dropped.
  void restart() {
    std::lock_guard lock(mutex);
    ++epoch;
    queue.clear();
    results.clear();
  }
};

DataLoader::DataLoader(std::shared_ptr<const Dataset> dataset, DataLoaderOptions options)
    : dataset_(std::move(dataset)), options_(options), engine_(options.seed) {
  WEAVE_CHECK(dataset_ != nullptr, "DataLoader", "dataset is null");
  WEAVE_CHECK(options.batch_size > 0, "DataLoader", "batch_size must be positive, found {}",
              options.batch_size);
  WEAVE_CHECK(!(options.sampler && options.shuffle), "DataLoader",
              "shuffle and a sampler exclude each other; hint: let the sampler shuffle");
  WEAVE_CHECK(options.num_workers >= 0 && options.prefetch >= 0, "DataLoader",
              "num_workers and prefetch must be >= 0, found {} and {}", options.num_workers,
              options.prefetch);
  WEAVE_CHECK(options.num_workers <= kMaxWorkers, "DataLoader",
              "num_workers must be at most {}, found {}; hint: a few workers per core keep any "
              "model fed, more only contend for the cores",
              kMaxWorkers, options.num_workers);
  order_.resize(options.sampler ? options.sampler->size() : dataset_->size());
  std::iota(order_.begin(), order_.end(), 0);
  if (options.num_workers > 0) {
    workers_ = std::make_unique<Workers>();
    workers_->dataset = dataset_;
    try {
      for (int i = 0; i < options.num_workers; ++i)
        workers_->threads.emplace_back([w = workers_.get()] { w->run(); });
    } catch (const std::system_error& e) {
      // The threads made so far must be joined before they are destroyed (else: terminate).
      const size_t started = workers_->threads.size();
      workers_->stop_and_join();
      WEAVE_FAIL("DataLoader",
                 "could not start worker thread {} of num_workers = {} ({}); hint: use fewer "
                 "workers (a few per core is plenty)",
                 started + 1, options.num_workers, e.what());
    }
  }
}

int64_t DataLoader::size() const {
  const int64_t n = static_cast<int64_t>(order_.size()), b = options_.batch_size;
  return options_.drop_last ? n / b : (n + b - 1) / b;
}

DataLoader::Iterator DataLoader::begin() {
  if (workers_) workers_->restart();
  if (resume_) {
    resume_ = false;
    return Iterator(this, position_);
  }
  position_ = 0;
  if (options_.sampler) {
    order_ = options_.sampler->indices();
    for (int64_t i : order_)
      WEAVE_CHECK(i >= 0 && i < dataset_->size(), "DataLoader",
                  "the sampler gave index {}, outside the dataset's {} examples", i,
                  dataset_->size());
  } else if (options_.shuffle) {
    std::iota(order_.begin(), order_.end(), 0);
    // Fisher-Yates with our own draws, so the order does not depend on the standard library.
    for (int64_t i = static_cast<int64_t>(order_.size()) - 1; i > 0; --i) {
      int64_t j = static_cast<int64_t>(engine_() % static_cast<uint64_t>(i + 1));
      std::swap(order_[i], order_[j]);
    }
  }
  return Iterator(this, 0);
}

LoaderState DataLoader::state() const {
  std::ostringstream generator;
  generator << engine_;
  const Sampler* sampler = options_.sampler.get();
  return {generator.str(),
          order_,
          position_,
          sampler ? sampler->state() : std::string(),
          options_.batch_size,
          sampler ? sampler->replicas() : 1,
          sampler ? sampler->replica() : 0};
}

bool DataLoader::resplits(const LoaderState& state) const {
  return state.replicas >= 1 && options_.sampler && state.replicas != options_.sampler->replicas();
}

namespace {
std::mt19937_64 parse_generator(const std::string& text) {
  std::istringstream in(text);
  std::mt19937_64 engine;
  in >> engine;
  WEAVE_CHECK(!in.fail(), "DataLoader", "the saved shuffle generator state is unreadable");
  return engine;
}
}  // namespace

void DataLoader::check_state(const LoaderState& state) const {
  parse_generator(state.generator);
  if (resplits(state)) {
    WEAVE_CHECK(state.batch_size > 0 && state.position >= 0, "DataLoader",
                "the saved state's batch size {} or position {} is not a loader's",
                state.batch_size, state.position);
    return;  // the saved order is another split's: this loader's is derived anew
  }
  WEAVE_CHECK(state.order.size() == order_.size(), "DataLoader",
              "the saved order covers {} examples, this loader {}; hint: same dataset and "
              "sampler as when it was saved",
              state.order.size(), order_.size());
  for (int64_t i : state.order)
    WEAVE_CHECK(i >= 0 && i < dataset_->size(), "DataLoader",
                "the saved order holds index {}, outside the dataset's {} examples", i,
                dataset_->size());
  WEAVE_CHECK(state.position >= 0 && state.position <= size(), "DataLoader",
              "the saved position {} is outside the epoch's {} batches", state.position, size());
  if (!options_.sampler)
    WEAVE_CHECK(state.sampler.empty(), "DataLoader",
                "the saved state has a sampler's, but this loader has no sampler");
}

void DataLoader::load_state(const LoaderState& state) {
  check_state(state);
  if (workers_) workers_->restart();
  if (options_.sampler) options_.sampler->load_state(state.sampler);
  engine_ = parse_generator(state.generator);
  if (resplits(state)) {
    order_ = options_.sampler->indices_from(state.position * state.batch_size * state.replicas);
    for (int64_t i : order_)
      WEAVE_CHECK(i >= 0 && i < dataset_->size(), "DataLoader",
                  "the sampler gave index {}, outside the dataset's {} examples", i,
                  dataset_->size());
    position_ = 0;
  } else {
    order_ = state.order;
    position_ = state.position;
  }
  resume_ = position_ < size();
}

std::vector<int64_t> DataLoader::indices_of(int64_t batch) const {
  const int64_t start = batch * options_.batch_size;
  const int64_t stop = std::min<int64_t>(start + options_.batch_size, order_.size());
  return {order_.begin() + start, order_.begin() + stop};
}

Example DataLoader::load(int64_t batch) const {
  return dataset_->get_batch(indices_of(batch));
}

DataLoader::~DataLoader() {
  if (workers_) workers_->stop_and_join();
}

Example DataLoader::take(int64_t batch) const {
  if (!workers_) return load(batch);
  Workers& w = *workers_;
  std::unique_lock lock(w.mutex);
  const int64_t last = std::min<int64_t>(size(), batch + 1 + options_.prefetch);
  for (int64_t b = batch; b < last; ++b)
    if (w.results.emplace(b, Workers::Result{}).second)
      w.queue.push_back({w.epoch, b, indices_of(b)});
  w.work.notify_all();
  w.done.wait(lock, [&] { return w.results.at(batch).ready; });
  Workers::Result result = std::move(w.results.at(batch));
  w.results.erase(w.results.begin(), w.results.upper_bound(batch));  // skipped ones too
  lock.unlock();
  if (result.error) std::rethrow_exception(result.error);
  return std::move(result.example);
}

const Example& DataLoader::Iterator::operator*() {
  if (!loaded_) {
    loader_->position_ = batch_ + 1;
    current_ = loader_->take(batch_);
    loaded_ = true;
  }
  return current_;
}

}  // namespace weave::data
