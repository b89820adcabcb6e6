#include "weave/ops/activation_checkpoint.h"

#include <algorithm>
#include <optional>
#include <unordered_set>
#include <utility>

#include "weave/autograd/engine.h"
#include "weave/autograd/grad_mode.h"
#include "weave/autograd/node.h"
#include "weave/ops/autocast.h"
#include "weave/tensor/trace.h"

namespace weave::autograd {

namespace detail {

namespace {
thread_local CheckpointRegion* keeping = nullptr;

// Makes `region` the keeping region on this thread for the scope's life.
class KeepingScope {
 public:
  explicit KeepingScope(CheckpointRegion* region) : outer_(std::exchange(keeping, region)) {}
  ~KeepingScope() { keeping = outer_; }
  KeepingScope(const KeepingScope&) = delete;
  KeepingScope& operator=(const KeepingScope&) = delete;

 private:
  CheckpointRegion* outer_;
};
thread_local int64_t reused = 0;
const std::vector<std::string> kKeepableKernels = {"matmul"};
}  // namespace

// A region's forward packs each saved tensor into a slot (it keeps only the slot's shape and
// dtype); the first unpack recomputes the region, whose saves fill the slots in the same order.
class CheckpointRegion final : public SavedTensorHooks {
 public:
  CheckpointRegion(CheckpointFunction fn, const std::vector<Tensor>& inputs,
                   const CheckpointOptions& options)
      : fn_(std::move(fn)),
        keep_(options.keep),
        default_generator_(default_generator()),
        autocast_(autocast_dtype()) {
    for (const Tensor& input : inputs) {
      inputs_.push_back(input.defined() ? input.detach() : Tensor());
      requires_grad_.push_back(input.defined() && input.requires_grad());
      versions_.push_back(input.defined() ? input.version() : 0);
    }
    for (Generator* generator : options.generators) {
      WEAVE_CHECK(generator != nullptr, "checkpoint", "options.generators holds a null pointer");
      generators_.emplace_back(generator, *generator);
    }
  }

  bool keeps(const char* kernel) const {
    return std::find(keep_.begin(), keep_.end(), kernel) != keep_.end();
  }

  // The differentiable collectives the region's forward issued, which the recomputation must
  // issue again one for one.
  void set_communicated_in_forward(uint64_t count) { communicated_in_forward_ = count; }

  int64_t pack(const Tensor& tensor) override {
    slot_meta_.push_back({tensor.shape(), tensor.dtype(), tensor.device()});
    return int64_t(slot_meta_.size() - 1);
  }

  Tensor unpack(int64_t slot) override {
    if (!recomputed_) recompute();
    const Slot& s = slots_[size_t(slot)];
    WEAVE_CHECK(s.tensor.version() == s.version, "checkpoint",
                "a tensor of shape {} saved by {} in a checkpointed region was modified in place "
                "by the recomputation: saved at version {}, now at version {}; hint: use an "
                "out-of-place op",
                s.tensor.shape(), current_node_name(), s.version, s.tensor.version());
    return s.tensor;
  }

  // The recomputation's saves, in order.
  void fill(const Tensor& tensor) {
    const size_t index = filled_++;
    if (index >= slot_meta_.size()) return;  // reported after the recomputation
    const TensorMeta& meta = slot_meta_[index];
    WEAVE_CHECK(tensor.shape() == meta.shape && tensor.dtype() == meta.dtype, "checkpoint",
                "the recomputation diverged from the forward: saved tensor {} is {} {} now, "
                "{} {} in forward; hint: the checkpointed function must do the same work given "
                "the same inputs",
                index, tensor.dtype(), tensor.shape(), meta.dtype, meta.shape);
    slots_[index] = {tensor.detach(), tensor.version()};
  }

  Tensor keep_or_replay(const char* kernel, const std::function<Tensor()>& compute) {
    if (!forward_done_) {
      Tensor result = compute();
      kept_.push_back({kernel, result, result.version()});
      return result;
    }
    WEAVE_CHECK(replayed_ < kept_.size() && kept_[replayed_].kernel == kernel, "checkpoint",
                "the recomputation diverged from the forward: kernel call {} is {}, forward "
                "kept {}; hint: the checkpointed function must do the same work given the same "
                "inputs",
                replayed_, kernel, replayed_ < kept_.size() ? kept_[replayed_].kernel : "nothing");
    const Kept& kept = kept_[replayed_++];
    WEAVE_CHECK(kept.result.version() == kept.version, "checkpoint",
                "a kept {} result of shape {} was modified in place after the forward computed "
                "it (version {}, now {}), so the recomputation cannot reuse it; hint: use an "
                "out-of-place op after it, or leave '{}' out of options.keep",
                kernel, kept.result.shape(), kept.version, kept.result.version(), kernel);
    ++reused;
    return kept.result;
  }

 private:
  struct Slot {
    Tensor tensor;
    uint64_t version = 0;
  };
  struct Kept {
    std::string kernel;
    Tensor result;
    uint64_t version = 0;
  };

  // Routes the recomputation's saves to fill() and keeps them as plain saved tensors there.
  class Collector final : public SavedTensorHooks {
   public:
    explicit Collector(CheckpointRegion& region) : region_(region) {}
    int64_t pack(const Tensor& tensor) override {
      region_.fill(tensor);
      return -1;
    }
    Tensor unpack(int64_t) override { WEAVE_FAIL("checkpoint", "no slot to unpack"); }

   private:
    CheckpointRegion& region_;
  };

  // Swaps generators to their state at the region's start, and back.
  class GeneratorReplay {
   public:
    explicit GeneratorReplay(CheckpointRegion& region) : region_(region) { swap(); }
    ~GeneratorReplay() { swap(); }

   private:
    void swap() {
      std::swap(default_generator(), region_.default_generator_);
      for (auto& [generator, state] : region_.generators_) std::swap(*generator, state);
    }
    CheckpointRegion& region_;
  };

  void recompute() {
    for (size_t i = 0; i < inputs_.size(); ++i)
      WEAVE_CHECK(!inputs_[i].defined() || inputs_[i].version() == versions_[i], "checkpoint",
                  "input {} (shape {}) of a checkpointed region was modified in place after the "
                  "forward (version {}, now {}), so recomputing it would give other values; "
                  "hint: clone() it before modifying",
                  i, inputs_[i].shape(), versions_[i], inputs_[i].version());
    const trace::Scope trace_scope("backward", "recompute");
    slots_.assign(slot_meta_.size(), {});
    filled_ = 0;
    replayed_ = 0;
    forward_done_ = true;
    std::vector<Tensor> inputs;
    for (size_t i = 0; i < inputs_.size(); ++i) {
      Tensor input = inputs_[i].defined() ? inputs_[i].detach() : Tensor();
      if (requires_grad_[i]) input.requires_grad_(true);
      inputs.push_back(std::move(input));
    }
    {
      EnableGradGuard grad_mode;
      RecomputeGuard forward_again;
      ForwardOnlyGuard no_pending_collectives;  // the recomputed graph is never backpropagated
      std::optional<AutocastGuard> autocast;
      if (autocast_)
        autocast.emplace(*autocast_);
      else if (autocast_dtype())
        autocast.emplace(kBFloat16, false);
      GeneratorReplay generators(*this);
      SavedTensorHooksGuard collect(std::make_shared<Collector>(*this));
      KeepingScope replay(keep_.empty() ? nullptr : this);
      const uint64_t marked_before = must_run_marked();
      fn_(inputs);
      const uint64_t communicated = must_run_marked() - marked_before;
      // Checked first: peers that pair these collectives with their own are the ones that
      // suffer, so this is the divergence to name.
      WEAVE_CHECK(communicated == communicated_in_forward_, "checkpoint",
                  "the recomputation diverged from the forward: it issued {} differentiable "
                  "collectives, the forward {}, so they no longer pair with the other ranks'; "
                  "hint: the checkpointed function must communicate the same way given the same "
                  "inputs (branch on nothing but them, not on a counter or a rank-local flag)",
                  communicated, communicated_in_forward_);
    }
    WEAVE_CHECK(filled_ == slot_meta_.size(), "checkpoint",
                "the recomputation diverged from the forward: it saved {} tensors for backward, "
                "the forward {}; hint: the checkpointed function must do the same work given "
                "the same inputs (branch on nothing but them)",
                filled_, slot_meta_.size());
    WEAVE_CHECK(replayed_ == kept_.size(), "checkpoint",
                "the recomputation diverged from the forward: it used {} of the {} kept kernel "
                "results",
                replayed_, kept_.size());
    recomputed_ = true;
  }

  CheckpointFunction fn_;
  std::vector<std::string> keep_;
  std::vector<Tensor> inputs_;
  std::vector<bool> requires_grad_;
  std::vector<uint64_t> versions_;
  Generator default_generator_;
  std::vector<std::pair<Generator*, Generator>> generators_;
  std::optional<DType> autocast_;
  std::vector<TensorMeta> slot_meta_;
  std::vector<Slot> slots_;
  size_t filled_ = 0;
  std::vector<Kept> kept_;
  size_t replayed_ = 0;
  bool forward_done_ = false;  // from the first recomputation on, kept results are handed back
  bool recomputed_ = false;
  uint64_t communicated_in_forward_ = 0;
};

CheckpointRegion* keeping_region() {
  return keeping;
}

Tensor keep_result(CheckpointRegion& region, const char* kernel,
                   const std::function<Tensor()>& compute) {
  if (!region.keeps(kernel)) return compute();
  const KeepingScope nested(nullptr);  // a kept kernel's own work is not kept twice
  return region.keep_or_replay(kernel, compute);
}

int64_t reused_results() {
  return reused;
}

}  // namespace detail

namespace {

// Whether the graph recorded since sequence number `first` leads from the outputs to an input.
bool reaches_inputs(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                    uint64_t first) {
  std::unordered_set<const Node*> targets, seen;
  for (const Tensor& input : inputs)
    if (input.defined() && input.requires_grad())
      if (Edge edge = gradient_edge(input); edge.is_valid()) targets.insert(edge.function.get());
  std::vector<const Node*> stack;
  for (const Tensor& output : outputs)
    if (output.defined() && output.grad_fn()) stack.push_back(output.grad_fn().get());
  while (!stack.empty()) {
    const Node* node = stack.back();
    stack.pop_back();
    if (targets.count(node)) return true;
    if (node->sequence_nr() < first || !seen.insert(node).second) continue;
    for (const Edge& edge : node->next_edges())
      if (edge.is_valid()) stack.push_back(edge.function.get());
  }
  return false;
}

}  // namespace

std::vector<Tensor> checkpoint(const CheckpointFunction& fn, const std::vector<Tensor>& inputs,
                               const CheckpointOptions& options) {
  WEAVE_CHECK(fn != nullptr, "checkpoint", "expected a function, found an empty one");
  for (const std::string& kernel : options.keep)
    WEAVE_CHECK(std::find(detail::kKeepableKernels.begin(), detail::kKeepableKernels.end(),
                          kernel) != detail::kKeepableKernels.end(),
                "checkpoint", "options.keep names '{}', expected one of: {}", kernel,
                fmt::join(detail::kKeepableKernels, ", "));
  if (!GradMode::is_enabled()) return fn(inputs);

  auto region = std::make_shared<detail::CheckpointRegion>(fn, inputs, options);
  const uint64_t first = next_sequence_nr();
  std::vector<Tensor> outputs;
  {
    detail::SavedTensorHooksGuard hooks(region);
    const detail::KeepingScope keep(options.keep.empty() ? nullptr : region.get());
    const uint64_t marked_before = must_run_marked();
    outputs = fn(inputs);
    region->set_communicated_in_forward(must_run_marked() - marked_before);
  }
  const bool any_output = std::any_of(outputs.begin(), outputs.end(), [](const Tensor& t) {
    return t.defined() && t.requires_grad();
  });
  WEAVE_CHECK(any_output, "checkpoint",
              "no output of the checkpointed function requires grad ({} outputs), so backward "
              "never reaches it and there is nothing to recompute; hint: call the function "
              "directly, or check that its inputs or parameters require grad",
              outputs.size());
  const bool any_input = std::any_of(inputs.begin(), inputs.end(), [](const Tensor& t) {
    return t.defined() && t.requires_grad();
  });
  WEAVE_CHECK(!any_input || reaches_inputs(outputs, inputs, first), "checkpoint",
              "no output of the checkpointed function depends on its inputs, so their gradients "
              "would silently be zero; hint: pass the tensors the function computes from as its "
              "inputs");
  return outputs;
}

Tensor checkpoint(const std::function<Tensor(const Tensor&)>& fn, const Tensor& input,
                  const CheckpointOptions& options) {
  WEAVE_CHECK(fn != nullptr, "checkpoint", "expected a function, found an empty one");
  return checkpoint([fn](const std::vector<Tensor>& in) { return std::vector<Tensor>{fn(in[0])}; },
                    {input}, options)[0];
}

}  // namespace weave::autograd
