#include "weave/nn/module.h"

#include <algorithm>
#include <set>

#include "weave/autograd/grad_mode.h"
#include "weave/nn/deferred.h"
#include "weave/tensor/tensor_impl.h"

namespace weave::nn {

Tensor Module::forward(const Tensor&) {
  WEAVE_FAIL(name_, "this module has no single-input forward(); call its own methods instead");
}

Tensor Module::forward_inputs(const Inputs& inputs) {
  return forward(inputs.x);
}

Tensor Module::operator()(const Tensor& input) {
  return (*this)(Inputs(input));
}

Tensor Module::operator()(const Inputs& inputs) {
  if (hooks_->pre.empty() && hooks_->post.empty()) return forward_inputs(inputs);
  return call(inputs, [this](const Inputs& in) { return forward_inputs(in); });
}

Tensor Module::call(const Inputs& inputs, const std::function<Tensor(const Inputs&)>& body) {
  // Copies: a hook may remove itself (or register another) while they run.
  auto pre = hooks_->pre;
  Tensor x = inputs.x;
  for (auto& [id, hook] : pre)
    if (Tensor replaced = hook(*this, x); replaced.defined()) x = replaced;
  Tensor y = body(inputs.with(x));
  auto post = hooks_->post;
  for (auto& [id, hook] : post)
    if (Tensor replaced = hook(*this, x, y); replaced.defined()) y = replaced;
  return y;
}

template <class Hook>
HookHandle Module::add_hook(std::vector<std::pair<uint64_t, Hook>> ForwardHooks::*list, Hook hook) {
  WEAVE_CHECK(hook != nullptr, name_, "expected a hook function, found an empty one");
  const uint64_t id = hooks_->next_id++;
  ((*hooks_).*list).emplace_back(id, std::move(hook));
  return HookHandle([weak = std::weak_ptr<ForwardHooks>(hooks_), list, id] {
    if (auto hooks = weak.lock())
      std::erase_if((*hooks).*list, [id](const auto& entry) { return entry.first == id; });
  });
}

HookHandle Module::register_forward_pre_hook(ForwardPreHook hook) {
  return add_hook(&ForwardHooks::pre, std::move(hook));
}

HookHandle Module::register_forward_hook(ForwardHook hook) {
  return add_hook(&ForwardHooks::post, std::move(hook));
}

void Module::register_wrapped_module(std::shared_ptr<Module> module) {
  WEAVE_CHECK(module != nullptr, name_, "expected a module to wrap, found null");
  WEAVE_CHECK(children_.empty() && parameters_.empty() && buffers_.empty(), name_,
              "a wrapper holds one unnamed module and nothing else");
  children_.emplace_back("", std::move(module));
}

void Module::unregister_module(const std::string& name) {
  const auto found = std::find_if(children_.begin(), children_.end(),
                                  [&](const auto& child) { return child.first == name; });
  WEAVE_CHECK(found != children_.end(), name_, "no submodule '{}' to remove", name);
  children_.erase(found);
}

std::vector<Tensor> trainable_parameters(const Module& model) {
  std::vector<Tensor> out;
  for (const Tensor& p : model.parameters())
    if (p.requires_grad()) out.push_back(p);
  return out;
}

std::string member_prefix(const std::string& prefix, const std::string& child_name) {
  return child_name.empty() ? prefix : prefix + child_name + ".";
}

namespace {
void visit_below(Module& module, const std::string& path,
                 const std::function<void(Module&, const std::string&)>& visit,
                 const std::function<bool(Module&)>& descend) {
  visit(module, path);
  if (descend && !descend(module)) return;
  for (const auto& [name, child] : module.named_children())
    visit_below(*child, name.empty() || path.empty() ? path + name : path + "." + name, visit,
                descend);
}
}  // namespace

void visit_modules(Module& root, const std::function<void(Module&, const std::string&)>& visit,
                   const std::function<bool(Module&)>& descend) {
  visit_below(root, "", visit, descend);
}

void Module::check_new_name(const std::string& name) const {
  WEAVE_CHECK(!name.empty() && name.find('.') == std::string::npos, name_,
              "invalid member name '{}': expected a non-empty name without '.'", name);
  auto taken = [&](const auto& list) {
    for (const auto& [n, v] : list)
      if (n == name) return true;
    return false;
  };
  WEAVE_CHECK(!taken(parameters_) && !taken(buffers_) && !taken(children_), name_,
              "'{}' is already registered", name);
}

Tensor& Module::register_parameter(const std::string& name, Tensor value, bool requires_grad) {
  check_new_name(name);
  parameters_.emplace_back(
      name, std::make_unique<Tensor>(register_value(std::move(value), name, requires_grad)));
  return *parameters_.back().second;
}

Tensor Module::register_value(Tensor value, const std::string& name, bool requires_grad) const {
  Tensor leaf = !value.defined() || value.is_leaf() ? value : value.detach();
  if (requires_grad && leaf.defined()) leaf.requires_grad_(true);
  if (DeferredValues* values = deferred_values(leaf)) values->registered_as = name_ + "." + name;
  return leaf;
}

void Module::name_deferred_parameters(const std::string& child_name, const Module& child) {
  for (const auto& [name, p] : child.named_parameters())
    if (is_deferred(p)) deferred_values(p)->registered_as = member_prefix("", child_name) + name;
}

Tensor& Module::register_buffer(const std::string& name, Tensor value) {
  check_new_name(name);
  buffers_.emplace_back(name, std::make_unique<Tensor>(value.defined() ? value.detach() : value));
  return *buffers_.back().second;
}

namespace {
template <class Get>
void collect(const Module& module, const std::string& prefix, bool recurse, NamedTensors& out,
             Get get) {
  for (const auto& [name, tensor] : get(module)) out.emplace_back(prefix + name, tensor);
  if (!recurse) return;
  for (const auto& [name, child] : module.named_children())
    collect(*child, member_prefix(prefix, name), true, out, get);
}
}  // namespace

// A tensor reachable under several names (a tied weight, a module registered twice) is listed
// once, under its first name, so optimizers and data-parallel wrappers see it once.
namespace {
void drop_repeats(NamedTensors& named) {
  std::set<const void*> seen;
  std::erase_if(named, [&](const auto& entry) { return !seen.insert(entry.second.impl()).second; });
}
}  // namespace

NamedTensors Module::named_parameters(bool recurse) const {
  NamedTensors out;
  collect(*this, "", recurse, out, [](const Module& m) {
    NamedTensors own;
    for (const auto& [n, t] : m.parameters_)
      if (t->defined()) own.emplace_back(n, *t);
    return own;
  });
  drop_repeats(out);
  return out;
}

NamedTensors Module::named_buffers(bool recurse) const {
  NamedTensors out;
  collect(*this, "", recurse, out, [](const Module& m) {
    NamedTensors own;
    for (const auto& [n, t] : m.buffers_)
      if (t->defined()) own.emplace_back(n, *t);
    return own;
  });
  drop_repeats(out);
  return out;
}

std::vector<Tensor> Module::parameters(bool recurse) const {
  std::vector<Tensor> out;
  for (auto& [name, t] : named_parameters(recurse)) out.push_back(t);
  return out;
}

std::vector<Tensor> Module::buffers(bool recurse) const {
  std::vector<Tensor> out;
  for (auto& [name, t] : named_buffers(recurse)) out.push_back(t);
  return out;
}

void Module::train(bool on) {
  training_ = on;
  for (auto& [name, child] : children_) child->train(on);
}

void Module::zero_grad(bool set_to_none) {
  for (Tensor& p : parameters()) {
    if (!p.grad().defined()) continue;
    if (set_to_none) {
      p.set_grad({});
    } else {
      NoGradGuard no_grad;
      p.grad().zero_();
    }
  }
}

NamedTensors Module::state_dict() const {
  NamedTensors state = named_parameters();
  for (auto& entry : named_buffers()) state.push_back(entry);
  return state;
}

void Module::check_state_dict(const NamedTensors& state, bool strict, bool same_dtypes) const {
  std::map<std::string, Tensor> own;
  for (auto& [name, t] : state_dict()) own.emplace(name, t);
  std::set<std::string> seen;
  for (const auto& [name, value] : state) {
    auto it = own.find(name);
    if (it == own.end()) {
      WEAVE_CHECK(!strict, "load_state_dict", "unexpected key '{}' in the state dict", name);
      continue;
    }
    WEAVE_CHECK(value.defined(), "load_state_dict", "'{}' is an undefined tensor", name);
    WEAVE_CHECK(it->second.shape() == value.shape(), "load_state_dict",
                "'{}' has shape {} in the module but {} in the state dict", name,
                it->second.shape(), value.shape());
    WEAVE_CHECK(!same_dtypes || it->second.dtype() == value.dtype(), "load_state_dict",
                "'{}' is {} in the module but {} in the state dict", name, it->second.dtype(),
                value.dtype());
    WEAVE_CHECK(seen.insert(name).second, "load_state_dict", "'{}' appears twice in the state dict",
                name);
  }
  if (strict)
    for (const auto& [name, t] : own)
      WEAVE_CHECK(seen.count(name), "load_state_dict", "missing key '{}' in the state dict", name);
}

void Module::load_state_dict(const NamedTensors& state, bool strict) {
  check_state_dict(state, strict);
  NoGradGuard no_grad;
  std::map<std::string, Tensor> own;
  for (auto& [name, t] : state_dict()) own.emplace(name, t);
  for (const auto& [name, value] : state) {
    auto it = own.find(name);
    if (it == own.end()) continue;
    materialize_for_overwrite(it->second);  // a deferred parameter takes the values as they are
    it->second.copy_(value);
  }
}

template <class Fn>
void Module::for_each_tensor(Fn&& fn, std::map<const void*, std::pair<Tensor, Tensor>>& done) {
  // A tensor reachable twice (a tied weight) is converted once, and both places get the result.
  auto convert = [&](Tensor& t, bool leaf) {
    auto it = done.find(t.impl());
    if (it != done.end()) {
      t = it->second.second;
      return;
    }
    const Tensor original = t;
    Tensor moved = fn(t);
    if (!moved.is_same(t)) {
      const bool grad = leaf && t.requires_grad();
      const AutogradMeta* meta = t.impl()->autograd.get();
      const std::shared_ptr<const PlacementRecord> placement = meta ? meta->placement : nullptr;
      const std::optional<uint64_t> seed = meta ? meta->drawn_with_seed : std::nullopt;
      t = moved.detach();
      if (grad) t.requires_grad_(true);
      if (placement) t.impl()->meta().placement = placement;
      if (seed) t.impl()->meta().drawn_with_seed = seed;
    }
    done.emplace(original.impl(), std::make_pair(original, t));  // keeps the key's tensor alive
  };
  for (auto& [name, t] : parameters_)
    if (t->defined()) convert(*t, true);
  for (auto& [name, t] : buffers_)
    if (t->defined()) convert(*t, false);
  for (auto& [name, child] : children_) child->for_each_tensor(fn, done);
}

void Module::to(Device device) {
  std::map<const void*, std::pair<Tensor, Tensor>> done;
  for_each_tensor(
      [&](const Tensor& t) {
        if (!is_deferred(t) || t.device() == device) return is_deferred(t) ? t : t.to(device);
        return deferred_to(t, t.dtype(), device);
      },
      done);
}

void Module::to(DType dtype) {
  std::map<const void*, std::pair<Tensor, Tensor>> done;
  for_each_tensor(
      [&](const Tensor& t) {
        if (!is_floating(t.dtype()) || t.dtype() == dtype) return t;
        return is_deferred(t) ? deferred_to(t, dtype, t.device()) : t.to(dtype);
      },
      done);
}

}  // namespace weave::nn
