#pragma once
// Module: parameters, buffers and submodules registered by name, in a deterministic order.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "weave/ops/ops.h"

namespace weave::nn {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

/// What a forward takes: the main input `x` (what one layer hands the next) and the side inputs
/// of a sequence model, which every layer may read and none changes: the positions of the
/// tokens (rotary embeddings; a packed document restarts at 0) and their documents (attention
/// stays within one). They travel unchanged through Sequential, hooks, activation checkpointing
/// and the data-parallel wrappers. A Tensor converts to Inputs, so single-input code is
/// unchanged:
///
///   Tensor logits = model({tokens, positions, document_ids});   // [B, T] each
///   Tensor y = mlp(x);                                           // Inputs{x}
struct Inputs {
  Tensor x;
  /// int64 or int32, [B, T] or [T]; undefined: 0 .. T - 1.
  Tensor positions{};
  /// int64 or int32, [B, T] or [T]; undefined: one document.
  Tensor document_ids{};

  Inputs(Tensor input) : x(std::move(input)) {}  // NOLINT: converting is the point
  Inputs(Tensor input, Tensor positions_, Tensor document_ids_)
      : x(std::move(input)),
        positions(std::move(positions_)),
        document_ids(std::move(document_ids_)) {}
  /// The same side inputs with another main input (what a layer passes on).
  Inputs with(Tensor next) const { return {std::move(next), positions, document_ids}; }
};

class Module {
 public:
  explicit Module(std::string name = "Module") : name_(std::move(name)) {}
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  /// The computation of single-input modules.
  virtual Tensor forward(const Tensor& input);
  /// The computation of modules that read the side inputs too (a transformer block's positions
  /// and documents). By default forward(inputs.x): a module that reads none ignores them.
  virtual Tensor forward_inputs(const Inputs& inputs);
  /// Calling a module (what Sequential, the layers and the parallel wrappers do): the forward
  /// pre-hooks, forward_inputs(), then the forward hooks. Hooks see and may replace the main
  /// input and the output; the side inputs pass them unchanged. forward() and
  /// forward_inputs() called directly run no hooks.
  Tensor operator()(const Tensor& input);
  Tensor operator()(const Inputs& inputs);
  /// Runs `body` as this module's forward, between its hooks: what a forward of another
  /// signature (a block's decoding step with its KV cache) calls, so that wrappers whose hooks
  /// gather the module's parameters (fully sharded data parallelism) see it too.
  ///
  ///   h = block.call(Inputs(h), [&](const Inputs& in) { return block.forward(in, cache); });
  Tensor call(const Inputs& inputs, const std::function<Tensor(const Inputs&)>& body);
  /// The submodules, by parameter prefix ("blocks.0"), that a fully sharded wrapper gathers one
  /// at a time when told no units of its own: a model's blocks and its other large parts. Empty
  /// (the default): the wrapper groups the direct children.
  virtual std::vector<std::string> shard_units() const { return {}; }

  /// Runs before forward with the input; returning a defined tensor replaces the input.
  using ForwardPreHook = std::function<Tensor(Module& module, const Tensor& input)>;
  /// Runs after forward with the input and output; returning a defined tensor replaces the
  /// output.
  using ForwardHook =
      std::function<Tensor(Module& module, const Tensor& input, const Tensor& output)>;
  /// Hooks run in registration order on every call of this module (not of its children), for
  /// logging or checking activations, or for wrappers that prepare parameters before a forward
  /// and release them after (sharded data parallelism). The handle removes the hook; dropping
  /// it keeps the hook. An exception from a hook propagates out of the call.
  HookHandle register_forward_pre_hook(ForwardPreHook hook);
  HookHandle register_forward_hook(ForwardHook hook);
  /// Whether a forward hook or pre-hook is registered on this module (not its children).
  bool has_forward_hooks() const { return !hooks_->pre.empty() || !hooks_->post.empty(); }
  const std::string& name() const { return name_; }

  /// "fc1.weight" style names, registration order, depth first. Deterministic, so every rank
  /// of a distributed job lists parameters identically. A tensor reachable under several names
  /// (a tied weight, a module registered twice) is listed once, under its first name.
  NamedTensors named_parameters(bool recurse = true) const;
  std::vector<Tensor> parameters(bool recurse = true) const;
  NamedTensors named_buffers(bool recurse = true) const;
  std::vector<Tensor> buffers(bool recurse = true) const;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> named_children() const {
    return children_;
  }

  /// Sets training mode here and in every submodule (affects Dropout and the like).
  virtual void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }
  /// Drops (set_to_none) or zeroes every parameter's gradient.
  void zero_grad(bool set_to_none = true);
  /// Parameters and buffers by name.
  NamedTensors state_dict() const;
  /// Removes the submodule registered as `name` (a layer dropping what it added later: merged
  /// adapters); raises if there is none.
  void unregister_module(const std::string& name);

  /// Raises, naming the entry, unless load_state_dict(state, strict) would succeed: with strict,
  /// missing or unexpected names are errors; shapes must always match; with same_dtypes, dtypes
  /// too (a checkpoint's rule; load_state_dict itself converts).
  void check_state_dict(const NamedTensors& state, bool strict = true,
                        bool same_dtypes = false) const;
  /// Copies values into the parameters and buffers of the same names (converting dtypes), after
  /// check_state_dict: on an error the module is unchanged.
  void load_state_dict(const NamedTensors& state, bool strict = true);
  /// Moves/converts every parameter and buffer (call before creating an optimizer).
  void to(Device device);
  void to(DType dtype);

 protected:
  /// Registers a parameter (made a leaf that requires grad) and returns a reference that
  /// stays valid (and follows to()). An undefined value reserves the name (an absent bias).
  Tensor& register_parameter(const std::string& name, Tensor value, bool requires_grad = true);
  Tensor& register_buffer(const std::string& name, Tensor value);
  /// `value` prepared as register_parameter prepares it (a leaf, requiring grad; a deferred one
  /// named), for assigning to a parameter registered before (its reference stays valid).
  Tensor register_value(Tensor value, const std::string& name, bool requires_grad = true) const;
  template <class M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> module) {
    check_new_name(name);
    children_.emplace_back(name, module);
    name_deferred_parameters(name, *module);
    return module;
  }
  /// Registers the one child of a wrapper without a name: its parameters and buffers keep
  /// their own names (no prefix), so a state dict loads with or without the wrapper.
  void register_wrapped_module(std::shared_ptr<Module> module);

 private:
  void check_new_name(const std::string& name) const;
  // A deferred parameter's errors name it as its outermost module so far does ("blocks.0.norm
  // .weight", not "RMSNorm.weight"): each registration under a parent renames the child's.
  static void name_deferred_parameters(const std::string& child_name, const Module& child);
  template <class Fn>
  void for_each_tensor(Fn&& fn, std::map<const void*, std::pair<Tensor, Tensor>>& done);

  std::string name_;
  bool training_ = true;
  // unique_ptr keeps references returned by register_* valid as more are added
  std::vector<std::pair<std::string, std::unique_ptr<Tensor>>> parameters_;
  std::vector<std::pair<std::string, std::unique_ptr<Tensor>>> buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  struct ForwardHooks {
    uint64_t next_id = 0;
    std::vector<std::pair<uint64_t, ForwardPreHook>> pre;
    std::vector<std::pair<uint64_t, ForwardHook>> post;
  };
  std::shared_ptr<ForwardHooks> hooks_ = std::make_shared<ForwardHooks>();
  template <class Hook>
  HookHandle add_hook(std::vector<std::pair<uint64_t, Hook>> ForwardHooks::*list, Hook hook);
};

/// The parameters that require grad, each once, in named_parameters' order: what an optimizer
/// of a model with a frozen part (adapters on a frozen base, nn/lora.h) takes.
std::vector<Tensor> trainable_parameters(const Module& model);

/// Calls visit(module, path) for `root` (path "") and every module under it, depth first in
/// registration order, with its path as parameter names prefix it ("blocks.0.attention");
/// `descend` (when given) says whether to go into a module's children.
void visit_modules(Module& root, const std::function<void(Module&, const std::string&)>& visit,
                   const std::function<bool(Module&)>& descend = nullptr);

/// The prefix of a child's member names: prefix + name + "." ("block0.attn."), or prefix itself
/// for a wrapper's unnamed child.
std::string member_prefix(const std::string& prefix, const std::string& child_name);

}  // namespace weave::nn
