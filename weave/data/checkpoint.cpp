#include "weave/data/checkpoint.h"

#include <nlohmann/json.hpp>
#include <sstream>

#include "weave/tensor/process.h"
#include "weave/tensor/random.h"

namespace weave::data {

namespace {

using json = nlohmann::json;

constexpr const char* kFormat = "1";

std::string engine_text(std::mt19937_64& engine) {
  std::ostringstream out;
  out << engine;
  return out.str();
}

const std::string& required(const Metadata& metadata, const std::string& key,
                            const std::string& name) {
  auto it = metadata.find(key);
  WEAVE_CHECK(it != metadata.end(), "load_checkpoint",
              "{} has no '{}'; hint: was it saved with the same parts (model, optimizer, "
              "scheduler, loader)?",
              name, key);
  return it->second;
}

json parse_json(const std::string& text, const std::string& key, const std::string& name) {
  json value = json::parse(text, nullptr, false);
  WEAVE_CHECK(!value.is_discarded(), "load_checkpoint", "{}: '{}' is not valid JSON", name, key);
  return value;
}

// The entries of `contents` under `prefix` ("model/"), with the prefix removed.
nn::NamedTensors under(const SafetensorsFile& contents, const std::string& prefix) {
  nn::NamedTensors out;
  for (const auto& [name, t] : contents.tensors)
    if (name.rfind(prefix, 0) == 0) out.emplace_back(name.substr(prefix.size()), t);
  return out;
}

// A loader whose order is one rank's share of the data (a DistributedSampler) restores only
// on a rank with the same share: elsewhere it would train this rank on that rank's batches.
// (Saved with another number of replicas, the loader re-splits the epoch instead.)
void check_owner(const Metadata& meta, const LoaderState& saved, const DataLoader& loader,
                 const std::string& name) {
  const auto& sampler = loader.options().sampler;
  if (!sampler || !sampler->per_rank() || loader.resplits(saved)) return;
  if (saved.replica >= 0) {
    WEAVE_CHECK(saved.replica == sampler->replica(), "load_checkpoint",
                "{} holds the data loader of replica {} of {}, and its order is that replica's "
                "share of the data (a DistributedSampler); restoring it on replica {} would train "
                "this rank on another's batches; hint: load the checkpoint of this rank's "
                "replica (parallel::load_sharded_checkpoint picks it)",
                name, saved.replica, saved.replicas, sampler->replica());
    return;
  }
  // Written before the loader recorded its split: the saving rank stands for it.
  const auto rank = meta.find("weave.rank");
  if (rank == meta.end()) return;
  const ProcessPlace place = process_place();
  const std::string here = fmt::format("{} of {}", place.rank, place.world_size);
  WEAVE_CHECK(rank->second == here, "load_checkpoint",
              "{} was saved by rank {}, and its data loader's order is that rank's share of "
              "the data (a DistributedSampler); restoring it on rank {} would train this rank on "
              "rank {}'s batches; hint: save one checkpoint per rank "
              "(parallel::save_sharded_checkpoint), or leave the loader out of a checkpoint shared "
              "by every rank and call sampler.set_epoch() on each",
              name, rank->second, here, rank->second);
}

}  // namespace

SafetensorsFile checkpoint_contents(const TrainingState& state) {
  SafetensorsFile out;
  out.metadata["weave.checkpoint"] = kFormat;
  const ProcessPlace place = process_place();
  if (place.world_size > 1)
    out.metadata["weave.rank"] = fmt::format("{} of {}", place.rank, place.world_size);
  if (state.model)
    for (const auto& [name, t] : state.model->state_dict())
      out.tensors.emplace_back("model/" + name, t);
  if (state.optimizer) {
    const optim::OptimizerState s = state.optimizer->state_dict();
    for (const auto& [name, t] : s.tensors) out.tensors.emplace_back("optimizer/" + name, t);
    out.metadata["optimizer"] = json(s.scalars).dump();
  }
  if (state.scheduler)
    out.metadata["scheduler.step"] = std::to_string(state.scheduler->step_count());
  if (state.loader) {
    const LoaderState s = state.loader->state();
    out.tensors.emplace_back("loader/order", from_vector(s.order, Shape{int64_t(s.order.size())}));
    out.metadata["loader"] =
        json{{"generator", s.generator},   {"position", s.position}, {"sampler", s.sampler},
             {"batch_size", s.batch_size}, {"replicas", s.replicas}, {"replica", s.replica}}
            .dump();
  }
  if (state.default_generator)
    out.metadata["rng.default"] = engine_text(default_generator().engine());
  for (const auto& [key, value] : state.user) out.metadata["user." + key] = value;
  return out;
}

void restore_checkpoint(const SafetensorsFile& contents, TrainingState& state,
                        const std::string& name, const std::function<void()>& before_changes) {
  const Metadata& meta = contents.metadata;
  WEAVE_CHECK(required(meta, "weave.checkpoint", name) == kFormat, "load_checkpoint",
              "{} is checkpoint format {}, this weave reads format {}", name,
              meta.at("weave.checkpoint"), kFormat);
  // Every known prefix; an entry under none of them is unexpected. The parts not being restored
  // are left alone (a model-only load from a training checkpoint, to export or evaluate it).
  for (const auto& [tensor, t] : contents.tensors) {
    const bool known = tensor.rfind("model/", 0) == 0 || tensor.rfind("optimizer/", 0) == 0 ||
                       tensor == "loader/order";
    WEAVE_CHECK(known, "load_checkpoint",
                "{} holds tensor '{}', which is no part of a training state (model, optimizer, "
                "loader); hint: is it a weave checkpoint?",
                name, tensor);
  }

  // ---- check everything ------------------------------------------------------------------
  nn::NamedTensors model;
  if (state.model) {
    model = under(contents, "model/");
    try {
      state.model->check_state_dict(model, /*strict=*/true, /*same_dtypes=*/true);
    } catch (const Error& e) {  // the same message, naming the file it came from
      WEAVE_FAIL("load_checkpoint", "{}: the model does not take it: {}", name, e.what());
    }
  }
  optim::OptimizerState optimizer;
  if (state.optimizer) {
    optimizer.tensors = under(contents, "optimizer/");
    const json scalars = parse_json(required(meta, "optimizer", name), "optimizer", name);
    WEAVE_CHECK(scalars.is_object(), "load_checkpoint", "{}: 'optimizer' is not an object", name);
    for (const auto& [key, value] : scalars.items()) {
      WEAVE_CHECK(value.is_number(), "load_checkpoint", "{}: optimizer '{}' is not a number", name,
                  key);
      optimizer.scalars[key] = value.get<double>();
    }
    state.optimizer->check_state_dict(optimizer);
  }
  int64_t scheduler_step = 0;
  if (state.scheduler) {
    const std::string& text = required(meta, "scheduler.step", name);
    char* end = nullptr;
    scheduler_step = std::strtoll(text.c_str(), &end, 10);
    WEAVE_CHECK(!text.empty() && *end == '\0' && scheduler_step >= 0, "load_checkpoint",
                "{}: scheduler.step '{}' is not a step count", name, text);
  }
  LoaderState loader;
  if (state.loader) {
    loader = parse_loader_metadata(required(meta, "loader", name), name);
    nn::NamedTensors order = under(contents, "loader/");
    WEAVE_CHECK(
        order.size() == 1 && order[0].second.dim() == 1 && order[0].second.dtype() == kInt64,
        "load_checkpoint", "{}: 'loader/order' is missing or not an int64 vector", name);
    loader.order = order[0].second.to_vector<int64_t>();
    state.loader->check_state(loader);
    check_owner(meta, loader, *state.loader, name);
  }
  std::mt19937_64 generator;
  if (state.default_generator) {
    std::istringstream in(required(meta, "rng.default", name));
    in >> generator;
    WEAVE_CHECK(!in.fail(), "load_checkpoint", "{}: rng.default is unreadable", name);
  }

  // ---- then change things (nothing below can fail on the checked contents) -----------------
  if (before_changes) before_changes();
  if (state.model) state.model->load_state_dict(model, true);
  if (state.optimizer) state.optimizer->load_state_dict(optimizer);
  if (state.scheduler) state.scheduler->set_step_count(scheduler_step);
  if (state.optimizer && state.scheduler)  // the saved rate wins over the schedule's rounding
    state.optimizer->set_lr(optimizer.scalars.at("lr"));
  if (state.loader) state.loader->load_state(loader);
  if (state.default_generator) default_generator().engine() = generator;
  state.user.clear();
  for (const auto& [key, value] : meta)
    if (key.rfind("user.", 0) == 0) state.user[key.substr(5)] = value;
}

void save_checkpoint(const std::string& path, const TrainingState& state) {
  const SafetensorsFile contents = checkpoint_contents(state);
  save_safetensors(path, contents.tensors, contents.metadata);
}

void load_checkpoint(const std::string& path, TrainingState& state) {
  restore_checkpoint(load_safetensors(path), state, path);
}

LoaderState parse_loader_metadata(const std::string& text, const std::string& name) {
  const json saved = parse_json(text, "loader", name);
  const bool shaped = saved.is_object() && saved.contains("generator") &&
                      saved["generator"].is_string() && saved.contains("position") &&
                      saved["position"].is_number_integer() && saved.contains("sampler") &&
                      saved["sampler"].is_string();
  WEAVE_CHECK(shaped, "load_checkpoint", "{}: 'loader' lacks generator, position or sampler", name);
  LoaderState loader;
  loader.generator = saved["generator"].get<std::string>();
  loader.position = saved["position"].get<int64_t>();
  loader.sampler = saved["sampler"].get<std::string>();
  if (saved.contains("batch_size") && saved.contains("replicas") && saved.contains("replica")) {
    WEAVE_CHECK(saved["batch_size"].is_number_integer() && saved["replicas"].is_number_integer() &&
                    saved["replica"].is_number_integer(),
                "load_checkpoint",
                "{}: 'loader' has a batch_size, replicas or replica that is not an integer", name);
    loader.batch_size = saved["batch_size"].get<int64_t>();
    loader.replicas = saved["replicas"].get<int>();
    loader.replica = saved["replica"].get<int>();
  }
  return loader;
}

}  // namespace weave::data
