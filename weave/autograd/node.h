#pragma once
// The backward graph: Node (one recorded op), Edge (a node's link to the node that produced
// one of its inputs), AccumulateGrad (the sink that writes a leaf's .grad()).
//
// Who owns what. A tensor owns its grad_fn (shared_ptr); a node owns the nodes its edges point
// at, so the graph lives exactly as long as some output tensor (or a must-run registration,
// engine.h) still holds its head, and dies from the head down once backward released it. A
// node owns the tensors it saved (SavedTensor: the data, never the saving tensor's handle, so
// saving an op's own output makes no cycle). A leaf owns its AccumulateGrad only weakly (the
// leaf keeps a weak_ptr and the graph keeps the node), and the node refers back to the leaf
// weakly too: dropping a parameter frees it even while an old graph survives.
//
// Which thread runs what. A graph is recorded by the thread running the forward and run by the
// thread calling backward(); nodes, hooks and callbacks run on that one thread, in the engine's
// order (engine.cpp), never concurrently. Hooks that start communication hand the transfer to
// a group's worker thread (distributed/queue.h) and only wait on it later, on this thread.
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "weave/tensor/tensor.h"

namespace weave::autograd {

class Node;

/// Points at input `input_nr` of `function`; an edge with no function carries no gradient.
struct Edge {
  std::shared_ptr<Node> function;
  uint32_t input_nr = 0;
  bool is_valid() const { return function != nullptr; }
};

/// Shape, dtype and device of one forward output: the engine makes zeros from it when an
/// output received no gradient, and checks gradients against it.
struct TensorMeta {
  Shape shape;
  DType dtype = kFloat32;
  Device device;
};

/// One recorded operation. Edges point from a node to nodes created before it, so running
/// ready nodes highest sequence number first replays the forward pass in exact reverse.
class Node : public std::enable_shared_from_this<Node> {
 public:
  explicit Node(uint64_t sequence_nr);
  Node();
  virtual ~Node() = default;
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  /// "MulBackward", "AccumulateGrad", ...
  virtual std::string name() const = 0;
  /// Gradients w.r.t. this node's forward outputs -> gradients w.r.t. its inputs (one per
  /// next edge; undefined where an input needs none).
  virtual std::vector<Tensor> apply(std::vector<Tensor>&& grad_outputs) = 0;
  /// Frees saved tensors after a backward without retain_graph.
  virtual void release_variables() {}

  uint64_t sequence_nr() const { return sequence_nr_; }
  const std::vector<Edge>& next_edges() const { return next_edges_; }
  std::vector<Edge>& mutable_next_edges() { return next_edges_; }
  bool needs_input_grad(size_t i) const {
    return i < next_edges_.size() && next_edges_[i].is_valid();
  }

  const std::vector<TensorMeta>& output_meta() const { return output_meta_; }
  /// Registers a forward output; returns its output number.
  uint32_t add_output(const Tensor& output);

  /// Hooks on the gradient of one output (how non-leaf tensor hooks are stored).
  struct PreHook {
    uint64_t id;
    uint32_t output_nr;
    GradHook hook;
  };
  std::vector<PreHook>& pre_hooks() { return pre_hooks_; }

 private:
  uint64_t sequence_nr_;
  std::vector<Edge> next_edges_;
  std::vector<TensorMeta> output_meta_;
  std::vector<PreHook> pre_hooks_;
};

/// Next value of this thread's node counter.
uint64_t next_sequence_nr();
/// A unique id for hook handles.
uint64_t next_hook_id();

/// Writes the incoming gradient into a leaf's grad() (summing with what is there), then runs
/// the leaf's post-accumulate-grad hooks. Runs as soon as it is ready (highest priority).
class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(const Tensor& leaf);
  std::string name() const override { return "AccumulateGrad"; }
  std::vector<Tensor> apply(std::vector<Tensor>&& grads) override;
  /// The leaf, or undefined if it has been destroyed.
  Tensor variable() const;

 private:
  std::weak_ptr<TensorImpl> variable_;
};

namespace detail {
/// The hooks every tensor saved for backward passes through, the way activation checkpointing
/// (ops/activation_checkpoint.h) drops a region's activations in forward and recomputes them in
/// backward. While hooks are installed on a thread, each SavedTensor made there asks pack():
/// a slot number (>= 0) is kept instead of the tensor, and unpack(slot) gives the tensor back
/// when backward needs it; -1 keeps the tensor itself.
class SavedTensorHooks {
 public:
  virtual ~SavedTensorHooks() = default;
  virtual int64_t pack(const Tensor& tensor) = 0;
  virtual Tensor unpack(int64_t slot) = 0;
};

/// Installs hooks on this thread while alive; guards nest (the innermost wins, and a null one
/// turns the hooks off inside).
class SavedTensorHooksGuard {
 public:
  explicit SavedTensorHooksGuard(std::shared_ptr<SavedTensorHooks> hooks);
  ~SavedTensorHooksGuard();
  SavedTensorHooksGuard(const SavedTensorHooksGuard&) = delete;
  SavedTensorHooksGuard& operator=(const SavedTensorHooksGuard&) = delete;

 private:
  std::shared_ptr<SavedTensorHooks> previous_;
};
}  // namespace detail

/// A tensor saved for backward. Remembers the version at save time; unpack() raises if the
/// tensor was modified in place since. It keeps a detached alias: the same storage and layout,
/// but no grad_fn and no link to the saved tensor's handle, so saving an op's own output never
/// makes the node keep that output (and through it, itself) alive. Inside a checkpointed region
/// it keeps a slot of the region instead, and unpack() recomputes.
class SavedTensor {
 public:
  SavedTensor() = default;
  explicit SavedTensor(const Tensor& tensor);
  /// The saved tensor; raises weave::Error naming the node, shape and versions if it changed.
  Tensor unpack() const;
  bool defined() const { return tensor_.defined() || slot_ >= 0; }

 private:
  Tensor tensor_;
  uint64_t saved_version_ = 0;
  std::shared_ptr<detail::SavedTensorHooks> hooks_;  // with slot_ >= 0: where the tensor is
  int64_t slot_ = -1;
};

/// What a recorded op's backward closure receives.
struct BackwardArgs {
  const std::vector<Tensor>& grads;  // one per forward output
  const Node& node;
  const Tensor& grad(size_t i = 0) const { return grads[i]; }
  bool needs(size_t input) const { return node.needs_input_grad(input); }
};
using BackwardFn = std::function<std::vector<Tensor>(const BackwardArgs&)>;

/// The node of every built-in op: a name and a backward closure that owns the saved tensors.
class FunctionNode final : public Node {
 public:
  FunctionNode(const char* name, BackwardFn backward)
      : name_(name), backward_(std::move(backward)) {}
  std::string name() const override { return name_; }
  std::vector<Tensor> apply(std::vector<Tensor>&& grads) override;
  void release_variables() override { backward_ = nullptr; }

 private:
  const char* name_;
  BackwardFn backward_;
};

/// The edge a gradient for `tensor` flows into: its grad_fn, its leaf accumulator, or none.
Edge gradient_edge(const Tensor& tensor);
/// True when grad mode is on and some input requires grad.
bool should_record(std::initializer_list<Tensor> inputs);
bool should_record(const std::vector<Tensor>& inputs);
/// Connects `node` to the inputs and makes it the grad_fn of the outputs.
void attach(const std::shared_ptr<Node>& node, const std::vector<Tensor>& inputs,
            const std::vector<Tensor>& outputs);

namespace detail {
// A backward may be given directly, or as a maker (no arguments) that returns it. The maker
// runs only when the op is recorded, so its saved tensors and closure cost nothing under
// NoGradGuard or when no input requires grad.
template <class BackwardOrMaker>
BackwardFn make_backward(BackwardOrMaker&& backward) {
  if constexpr (std::is_invocable_v<BackwardOrMaker&>)
    return BackwardFn(backward());
  else
    return BackwardFn(std::forward<BackwardOrMaker>(backward));
}
}  // namespace detail

/// Records an op: if grad mode is on and an input requires grad, output gets a FunctionNode
/// whose backward is `backward` (or what the maker `[&] { return [...](const BackwardArgs&)
/// {...}; }` returns: the recommended form, which builds nothing when nothing is recorded).
/// Returns output.
template <class BackwardOrMaker>
Tensor record(const char* name, std::initializer_list<Tensor> inputs, Tensor output,
              BackwardOrMaker&& backward) {
  if (!should_record(inputs)) return output;
  attach(std::make_shared<FunctionNode>(
             name, detail::make_backward(std::forward<BackwardOrMaker>(backward))),
         std::vector<Tensor>(inputs), {output});
  return output;
}
/// Variable-length inputs.
template <class BackwardOrMaker>
Tensor record(const char* name, const std::vector<Tensor>& inputs, Tensor output,
              BackwardOrMaker&& backward) {
  if (!should_record(inputs)) return output;
  attach(std::make_shared<FunctionNode>(
             name, detail::make_backward(std::forward<BackwardOrMaker>(backward))),
         inputs, {output});
  return output;
}
/// Multi-output version.
template <class BackwardOrMaker>
std::vector<Tensor> record(const char* name, std::initializer_list<Tensor> inputs,
                           std::vector<Tensor> outputs, BackwardOrMaker&& backward) {
  if (!should_record(inputs)) return outputs;
  attach(std::make_shared<FunctionNode>(
             name, detail::make_backward(std::forward<BackwardOrMaker>(backward))),
         std::vector<Tensor>(inputs), outputs);
  return outputs;
}

namespace detail {
bool grad_mode_enabled();
/// attach(), then must_run(node) (engine.h).
void attach_must_run(const std::shared_ptr<Node>& node, const std::vector<Tensor>& inputs,
                     const std::vector<Tensor>& outputs);
}  // namespace detail

/// Records a node whose backward communicates (a collective, a ring exchange): every rank of
/// the exchange must run its backward, so the node is marked must-run (engine.h), and it is
/// recorded when grad mode is on and `needed` holds, a condition every rank of the exchange
/// evaluates alike, rather than when this rank's inputs require grad (a rank may hold none that
/// do, yet its peers wait for its part of the backward). Inputs may be undefined.
template <class BackwardOrMaker>
std::vector<Tensor> record_communicating(const char* name, const std::vector<Tensor>& inputs,
                                         std::vector<Tensor> outputs, bool needed,
                                         BackwardOrMaker&& backward) {
  if (!needed || !detail::grad_mode_enabled()) return outputs;
  detail::attach_must_run(std::make_shared<FunctionNode>(
                              name, detail::make_backward(std::forward<BackwardOrMaker>(backward))),
                          inputs, outputs);
  return outputs;
}

/// Name of the node the engine is running on this thread ("" outside backward).
const std::string& current_node_name();

}  // namespace weave::autograd
