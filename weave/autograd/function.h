#pragma once
// Custom differentiable functions, PyTorch-style:
//
//   struct Cube : weave::autograd::Function<Cube> {
//     static constexpr const char* name = "CubeBackward";
//     static Tensor forward(FunctionContext& ctx, const Tensor& x) {
//       ctx.save_for_backward({x});
//       return x * x * x;
//     }
//     static std::vector<Tensor> backward(FunctionContext& ctx, const std::vector<Tensor>& g) {
//       Tensor x = ctx.saved()[0];
//       return {g[0] * 3.0 * x * x};  // one gradient per Tensor argument of forward
//     }
//   };
//   Tensor y = Cube::apply(x);
//
// forward runs without recording; backward receives one gradient per output (zeros where an
// output got none) and returns one per Tensor argument (undefined = no gradient).
//
// A function whose backward communicates (a collective or a send over the ranks) declares it:
//
//   struct SumOverRanks : weave::autograd::Function<SumOverRanks> {
//     static constexpr bool communicates = true;
//     static Tensor forward(FunctionContext&, const Tensor& x) {
//       Tensor y = x.clone();
//       weave::dist::all_reduce(y);
//       return y;
//     }
//     static std::vector<Tensor> backward(FunctionContext&, const std::vector<Tensor>& g) {
//       Tensor dx = g[0].clone();
//       weave::dist::all_reduce(dx);
//       return {dx};
//     }
//   };
//
// Its node is then marked must-run (engine.h): every rank's backward runs it, with a zero
// gradient where that rank's loss does not use the output, so the peers' collective in backward
// always has its partner. Without it, a rank whose loss ignores the output skips the node and
// the others wait for it. Every rank must record the node (an input requiring grad on every
// rank), as for the built-in collectives.
#include <any>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "weave/autograd/engine.h"
#include "weave/autograd/grad_mode.h"
#include "weave/autograd/node.h"

namespace weave::autograd {

/// Per-call state shared by a custom function's forward and backward.
class FunctionContext {
 public:
  /// Saves tensors; backward gets them back through saved(), checked for in-place changes.
  void save_for_backward(const std::vector<Tensor>& tensors) {
    saved_.clear();
    for (const Tensor& t : tensors) saved_.emplace_back(t);
  }
  std::vector<Tensor> saved() const {
    std::vector<Tensor> out;
    for (const SavedTensor& s : saved_) out.push_back(s.unpack());
    return out;
  }
  /// Whether the i-th Tensor argument needs a gradient (valid in backward).
  bool needs_input_grad(size_t i) const { return node_ && node_->needs_input_grad(i); }
  /// Anything else backward needs (sizes, flags, ...).
  std::map<std::string, std::any> data;

  void release() { saved_.clear(); }
  void set_node(const Node* node) { node_ = node; }

 private:
  std::vector<SavedTensor> saved_;
  const Node* node_ = nullptr;
};

/// Node type behind every custom function.
class CustomNode final : public Node {
 public:
  using Backward = std::vector<Tensor> (*)(FunctionContext&, const std::vector<Tensor>&);
  CustomNode(std::string name, std::shared_ptr<FunctionContext> ctx, Backward backward)
      : name_(std::move(name)), ctx_(std::move(ctx)), backward_(backward) {}
  std::string name() const override { return name_; }
  std::vector<Tensor> apply(std::vector<Tensor>&& grads) override {
    WEAVE_CHECK(!released_, "autograd",
                "trying to backward through {} a second time, but its saved tensors were freed; "
                "hint: pass retain_graph=true to the first backward",
                name_);
    ctx_->set_node(this);
    return backward_(*ctx_, grads);
  }
  void release_variables() override {
    ctx_->release();
    released_ = true;
  }

 private:
  std::string name_;
  std::shared_ptr<FunctionContext> ctx_;
  Backward backward_;
  bool released_ = false;
};

template <class Derived>
struct Function {
  /// Runs Derived::forward(ctx, args...) and records Derived::backward for its Tensor args.
  template <class... Args>
  static auto apply(Args&&... args) {
    auto ctx = std::make_shared<FunctionContext>();
    std::vector<Tensor> inputs;
    (collect(inputs, args), ...);
    using Result = decltype(Derived::forward(*ctx, std::forward<Args>(args)...));
    Result result;
    {
      NoGradGuard no_grad;
      result = Derived::forward(*ctx, std::forward<Args>(args)...);
    }
    std::vector<Tensor> outputs;
    if constexpr (std::is_same_v<Result, Tensor>) {
      outputs = {result};
    } else {
      outputs = result;
    }
    for (Tensor& out : outputs)  // an input passed through must not lose its own history
      for (const Tensor& in : inputs)
        if (out.is_same(in)) out = out.detach();
    if (should_record(inputs)) {
      std::string name = "CustomFunctionBackward";
      if constexpr (requires { Derived::name; }) name = Derived::name;
      auto node = std::make_shared<CustomNode>(
          name, ctx,
          [](FunctionContext& c, const std::vector<Tensor>& g) { return Derived::backward(c, g); });
      attach(node, inputs, outputs);
      if constexpr (requires { Derived::communicates; })
        if (Derived::communicates) must_run(node);
    }
    if constexpr (std::is_same_v<Result, Tensor>) {
      return outputs[0];
    } else {
      return outputs;
    }
  }

 private:
  template <class A>
  static void collect(std::vector<Tensor>& inputs, const A& arg) {
    if constexpr (std::is_same_v<std::decay_t<A>, Tensor>) inputs.push_back(arg);
  }
};

}  // namespace weave::autograd
