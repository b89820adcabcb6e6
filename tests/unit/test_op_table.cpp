// One table of every differentiable op. On CPU each case is gradient-checked against central
// finite differences in float64 (tests/test_op_table_cuda.cpp compares each case on a GPU with
// the CPU).
#include <cmath>
#include <functional>
#include <set>

#include "helpers.h"
#include "op_table.h"
#include "weave/kernels/functors.h"

using namespace weave;
using namespace weave::test;

namespace {

Input any(Shape s) {
  return {s};
}
Input pos(Shape s) {
  return {s, Domain::Positive};
}
Input tr(Shape s) {
  return {s, Domain::Any, true};
}

}  // namespace

std::vector<OpCase> weave::test::op_cases() {
  auto unary = [](std::string name, Tensor (*f)(const Tensor&), Domain d) {
    std::vector<OpCase> out;
    out.push_back({name, {{{}, d}}, [f](const Inputs& x) { return f(x[0]); }});
    out.push_back({name, {{{3, 4}, d}}, [f](const Inputs& x) { return f(x[0]); }});
    out.push_back({name, {{{4, 3}, d, true}}, [f](const Inputs& x) { return f(x[0]); }});
    return out;
  };
  auto binary = [](std::string name, Tensor (*f)(const Tensor&, const Tensor&), Domain d) {
    std::vector<OpCase> out;
    auto call = [f](const Inputs& x) { return f(x[0], x[1]); };
    out.push_back({name, {{{}, d}, {{}, d}}, call});
    out.push_back({name, {{{3, 4}, d}, {{3, 4}, d}}, call});
    out.push_back({name, {{{3, 1}, d}, {{1, 4}, d}}, call});    // broadcast both ways
    out.push_back({name, {{{2, 3, 4}, d}, {{4}, d}}, call});    // broadcast over leading dims
    out.push_back({name, {{{4, 3}, d, true}, {{}, d}}, call});  // non-contiguous with a scalar
    return out;
  };
  std::vector<OpCase> all;
  auto add_all = [&](std::vector<OpCase> more) { all.insert(all.end(), more.begin(), more.end()); };

  // One generated set of rows per op of the lists; only the input domain is per op.
  auto domain_of = [](const std::string& name) {
    static const std::set<std::string> positive = {"log", "sqrt", "rsqrt", "div", "pow"};
    return positive.count(name) ? Domain::Positive : Domain::Any;
  };
#define WEAVE_UNARY_ROWS(Name, Functor, function) \
  add_all(unary(                                  \
      #function, [](const Tensor& x) { return function(x); }, domain_of(#function)));
  WEAVE_UNARY_OPS(WEAVE_UNARY_ROWS)
#undef WEAVE_UNARY_ROWS
#define WEAVE_BINARY_ROWS(function)                                               \
  add_all(binary(                                                                 \
      #function, [](const Tensor& a, const Tensor& b) { return function(a, b); }, \
      domain_of(#function)));
  WEAVE_DIFFERENTIABLE_BINARY_OPS(WEAVE_BINARY_ROWS)
#undef WEAVE_BINARY_ROWS
  // tanh near saturation
  all.push_back({"tanh", {{{3, 4}, Domain::Unit}}, [](const Inputs& x) { return tanh(x[0]); }});
  all.push_back({"pow_scalar", {pos({3, 4})}, [](const Inputs& x) { return pow(x[0], 2.5); }});
  all.push_back({"scalar_ops", {any({3, 4})}, [](const Inputs& x) {
                   return (2.0 - x[0]) * 3.0 / (x[0] * x[0] + 1.0) + 0.5;
                 }});
  all.push_back({"where", {any({3, 4}), any({3, 4}), any({4})}, [](const Inputs& x) {
                   return where(gt(x[0], x[1]), x[1], x[2]);
                 }});

  all.push_back({"clamp", {any({3, 4})}, [](const Inputs& x) { return clamp(x[0], -0.5, 0.5); }});
  all.push_back(
      {"clamp", {tr({3, 4})}, [](const Inputs& x) { return clamp(x[0], std::nullopt, 0.3); }});
  all.push_back({"clamp", {any({})}, [](const Inputs& x) { return clamp(x[0], -0.2); }});

  for (Dims dims : {Dims{}, Dims{0}, Dims{1}, Dims{-1, 0}}) {
    for (bool keep : {false, true}) {
      all.push_back({"sum", {tr({3, 4})}, [=](const Inputs& x) { return sum(x[0], dims, keep); }});
      all.push_back(
          {"mean", {any({3, 4})}, [=](const Inputs& x) { return mean(x[0], dims, keep); }});
      all.push_back({"max", {any({3, 4})}, [=](const Inputs& x) { return max(x[0], dims, keep); }});
      all.push_back({"min", {tr({3, 4})}, [=](const Inputs& x) { return min(x[0], dims, keep); }});
    }
  }
  all.push_back({"sum", {any({2, 3, 4})}, [](const Inputs& x) { return sum(x[0], {0, 2}); }});
  all.push_back({"sum", {any({})}, [](const Inputs& x) { return sum(x[0]); }});
  all.push_back({"var", {any({3, 4})}, [](const Inputs& x) { return var(x[0], {1}); }});
  all.push_back({"var", {tr({3, 4})}, [](const Inputs& x) { return var(x[0], {}, 0, true); }});

  all.push_back(
      {"matmul", {any({3, 4}), any({4, 5})}, [](const Inputs& x) { return matmul(x[0], x[1]); }});
  all.push_back(
      {"matmul", {tr({3, 4}), tr({4, 5})}, [](const Inputs& x) { return matmul(x[0], x[1]); }});
  all.push_back({"matmul", {any({2, 3, 4}), any({4, 2})}, [](const Inputs& x) {
                   return matmul(x[0], x[1]);
                 }});
  all.push_back({"matmul", {any({2, 1, 3, 4}), any({3, 4, 2})}, [](const Inputs& x) {
                   return matmul(x[0], x[1]);
                 }});
  all.push_back(
      {"matmul", {any({4}), any({4, 3})}, [](const Inputs& x) { return matmul(x[0], x[1]); }});
  all.push_back(
      {"matmul", {any({3, 4}), any({4})}, [](const Inputs& x) { return matmul(x[0], x[1]); }});
  all.push_back(
      {"matmul", {any({4}), any({4})}, [](const Inputs& x) { return matmul(x[0], x[1]); }});
  all.push_back({"linear", {any({5, 4}), any({3, 4}), any({3})}, [](const Inputs& x) {
                   return linear(x[0], x[1], x[2]);
                 }});
  all.push_back(
      {"linear", {any({2, 5, 4}), tr({3, 4})}, [](const Inputs& x) { return linear(x[0], x[1]); }});
  // Three groups, the middle one empty (its weight's gradient is zero, not missing).
  all.push_back({"grouped_linear",
                 {any({5, 4}), any({3, 4}), any({3, 4}), any({3, 4}), any({3}), any({3}), any({3})},
                 [](const Inputs& x) {
                   return grouped_linear(x[0], {x[1], x[2], x[3]}, {2, 0, 3}, {x[4], x[5], x[6]});
                 }});
  all.push_back(
      {"grouped_linear", {tr({3, 4}), any({2, 2, 4}), any({2, 2, 4})}, [](const Inputs& x) {
         return grouped_linear(x[0], {x[1], x[2]}, {1, 2});
       }});
  // Row 0 picked twice (its gradient sums both), row 3 never, one slot empty (-1).
  all.push_back({"gather_weighted_sum", {any({4, 3}), any({3, 2})}, [](const Inputs& x) {
                   const Tensor index = from_vector<int64_t>({0, 2, 1, -1, 0, 1}, {3, 2});
                   return gather_weighted_sum(x[0], index.to(x[0].device()), x[1]);
                 }});

  all.push_back({"reshape", {tr({3, 4})}, [](const Inputs& x) {
                   return x[0].reshape({2, -1}) * 1.0;
                 }});
  all.push_back({"view", {any({3, 4})}, [](const Inputs& x) { return x[0].view({4, 3}).exp(); }});
  all.push_back(
      {"flatten", {any({2, 3, 2})}, [](const Inputs& x) { return x[0].flatten(1).exp(); }});
  all.push_back({"permute", {any({2, 3, 4})}, [](const Inputs& x) {
                   return x[0].permute({2, 0, 1}).exp();
                 }});
  all.push_back(
      {"transpose", {any({3, 4})}, [](const Inputs& x) { return x[0].transpose(0, 1).exp(); }});
  all.push_back(
      {"narrow", {any({5, 4})}, [](const Inputs& x) { return x[0].narrow(0, 1, 3).exp(); }});
  all.push_back(
      {"slice", {tr({6, 4})}, [](const Inputs& x) { return x[0].slice(0, 1, -1, 2).exp(); }});
  all.push_back(
      {"select", {any({3, 4})}, [](const Inputs& x) { return x[0].select(1, -1).exp(); }});
  all.push_back({"expand", {any({3, 1})}, [](const Inputs& x) {
                   return x[0].expand({2, 3, 4}).exp();
                 }});
  all.push_back(
      {"squeeze", {any({3, 1, 4})}, [](const Inputs& x) { return x[0].squeeze().exp(); }});
  all.push_back(
      {"unsqueeze", {any({3, 4})}, [](const Inputs& x) { return x[0].unsqueeze(1).exp(); }});
  all.push_back({"cat", {any({2, 3}), tr({4, 3}), any({1, 3})}, [](const Inputs& x) {
                   return cat({x[0], x[1], x[2]}, 0).exp();
                 }});
  all.push_back({"cat", {any({3, 2}), any({3, 1})}, [](const Inputs& x) {
                   return cat({x[0], x[1]}, -1).exp();
                 }});
  all.push_back({"stack", {any({3, 2}), any({3, 2})}, [](const Inputs& x) {
                   return stack({x[0], x[1]}, 1).exp();
                 }});
  all.push_back({"split", {any({5, 3})}, [](const Inputs& x) {
                   auto parts = split(x[0], 2, 0);
                   return parts[0].sum() *
                          parts[2].exp().sum();  // the middle piece gets no gradient
                 }});
  all.push_back({"chunk", {any({3, 6})}, [](const Inputs& x) {
                   auto parts = chunk(x[0], 3, 1);
                   return parts[0] * parts[1] + parts[2];
                 }});
  all.push_back(
      {"index_select", {any({5, 3})}, [](const Inputs& x) {
         return index_select(x[0], 0, from_vector<int64_t>({4, 0, 4, 2}, {}, x[0].device()));
       }});
  all.push_back({"index_select", {tr({3, 5})}, [](const Inputs& x) {
                   return index_select(x[0], 1, from_vector<int32_t>({1, -1}, {}, x[0].device()));
                 }});
  // Repeated picks: their gradients add up in one place.
  all.push_back(
      {"gather", {any({3, 4})}, [](const Inputs& x) {
         return gather(x[0], 1, from_vector<int64_t>({0, 3, 3, 1, -1, 2}, {3, 2}, x[0].device()));
       }});
  all.push_back(
      {"gather", {tr({4, 3})}, [](const Inputs& x) {
         return gather(x[0], 0, from_vector<int32_t>({3, 0, 1, 1, 2, 0}, {2, 3}, x[0].device()));
       }});
  all.push_back(
      {"take_along_dim", {any({3, 5})}, [](const Inputs& x) {  // one column per row
         return take_along_dim(x[0], from_vector<int64_t>({4, 0, 2}, {3, 1}, x[0].device()), 1);
       }});
  all.push_back(
      {"take_along_dim", {any({2, 5})}, [](const Inputs& x) {  // indices broadcast
         return take_along_dim(x[0], from_vector<int64_t>({1, 4}, {1, 2}, x[0].device()), -1);
       }});

  all.push_back({"softmax", {any({3, 5})}, [](const Inputs& x) { return softmax(x[0], -1); }});
  all.push_back({"softmax", {tr({3, 5})}, [](const Inputs& x) { return softmax(x[0], 0); }});
  all.push_back(
      {"log_softmax", {any({3, 5})}, [](const Inputs& x) { return log_softmax(x[0], 1); }});
  all.push_back({"log_softmax", {any({5})}, [](const Inputs& x) { return log_softmax(x[0]); }});
  all.push_back(
      {"cross_entropy", {any({4, 5})}, [](const Inputs& x) {
         return cross_entropy(x[0], from_vector<int64_t>({0, 4, 2, 2}, {}, x[0].device()));
       }});
  all.push_back({"cross_entropy", {any({4, 5})}, [](const Inputs& x) {
                   return cross_entropy(x[0], from_vector<int64_t>({1, 3, 0, 4}, {}, x[0].device()),
                                        Reduction::None);
                 }});
  all.push_back({"cross_entropy", {any({5})}, [](const Inputs& x) {
                   return cross_entropy(
                       x[0], scalar_tensor(3, {.dtype = kInt64, .device = x[0].device()}),
                       Reduction::Sum);
                 }});
  all.push_back({"mse_loss", {any({3, 4}), any({3, 4})}, [](const Inputs& x) {
                   return mse_loss(x[0], x[1]);
                 }});
  all.push_back({"mse_loss", {any({3, 4}), tr({3, 4})}, [](const Inputs& x) {
                   return mse_loss(x[0], x[1], Reduction::None);
                 }});
  all.push_back({"layer_norm", {any({3, 5}), any({5}), any({5})}, [](const Inputs& x) {
                   return layer_norm(x[0], {5}, x[1], x[2]);
                 }});
  all.push_back({"layer_norm", {any({2, 3, 4})}, [](const Inputs& x) {
                   return layer_norm(x[0], {3, 4});
                 }});
  all.push_back({"layer_norm", {tr({4, 5}), any({5})}, [](const Inputs& x) {
                   return layer_norm(x[0], {5}, x[1]);
                 }});
  all.push_back({"rms_norm", {any({3, 5}), any({5})}, [](const Inputs& x) {
                   return rms_norm(x[0], {5}, x[1]);
                 }});
  all.push_back({"rms_norm", {tr({4, 3})}, [](const Inputs& x) { return rms_norm(x[0], {3}); }});
  all.push_back({"swiglu", {any({3, 6})}, [](const Inputs& x) { return swiglu(x[0]); }});
  all.push_back({"swiglu", {tr({4, 2})}, [](const Inputs& x) { return swiglu(x[0]); }});
  all.push_back({"geglu", {any({2, 3, 4})}, [](const Inputs& x) { return geglu(x[0]); }});
  all.push_back({"geglu", {any({3, 4})}, [](const Inputs& x) { return geglu(x[0], true); }});
  all.push_back({"bias_gelu", {any({3, 5}), any({5})}, [](const Inputs& x) {
                   return bias_gelu(x[0], x[1]);
                 }});
  all.push_back({"bias_gelu", {tr({4, 3}), any({3})}, [](const Inputs& x) {
                   return bias_gelu(x[0], x[1], true);
                 }});
  all.push_back({"softmax", {any({2, 3, 4})}, [](const Inputs& x) { return softmax(x[0], 1); }});
  all.push_back({"softmax", {any({})}, [](const Inputs& x) { return softmax(x[0]) * x[0]; }});
  all.push_back(
      {"cross_entropy", {tr({4, 5})}, [](const Inputs& x) {
         // an ignored row adds nothing and the mean is over the other three
         return cross_entropy(x[0], from_vector<int64_t>({1, -100, 0, 4}, {}, x[0].device()));
       }});
  // Attention: causal and not, boolean and additive masks, Tq != Tk, strided [B, T, H, D] views.
  all.push_back({"scaled_dot_product_attention",
                 {any({2, 2, 3, 4}), any({2, 2, 3, 4}), any({2, 2, 3, 4})},
                 [](const Inputs& x) { return scaled_dot_product_attention(x[0], x[1], x[2]); }});
  all.push_back({"scaled_dot_product_attention",
                 {any({1, 2, 5, 3}), any({1, 2, 5, 3}), any({1, 2, 5, 2})},
                 [](const Inputs& x) {
                   return scaled_dot_product_attention(x[0], x[1], x[2], {.causal = true});
                 }});
  all.push_back({"scaled_dot_product_attention",
                 {any({1, 3, 2, 4}), any({1, 5, 2, 4}), any({1, 5, 2, 4})},
                 [](const Inputs& x) {  // [B, T, H, D] storage seen as [B, H, T, D]; Tq != Tk
                   return scaled_dot_product_attention(x[0].transpose(1, 2), x[1].transpose(1, 2),
                                                       x[2].transpose(1, 2),
                                                       {.causal = true, .scale = 0.7});
                 }});
  all.push_back(
      {"scaled_dot_product_attention",  // packed documents, grouped queries, causal
       {any({2, 4, 5, 2}), any({2, 2, 5, 2}), any({2, 2, 5, 3})},
       [](const Inputs& x) {
         Tensor ids = from_vector<int64_t>({0, 0, 1, 1, 1, 3, 4, 4, 4, 4}, {2, 5}, x[0].device());
         return scaled_dot_product_attention(x[0], x[1], x[2],
                                             {.causal = true, .document_ids = ids});
       }});
  all.push_back({"scaled_dot_product_attention",  // grouped queries: 4 query heads, 2 k/v heads
                 {any({1, 4, 3, 2}), any({1, 2, 4, 2}), any({1, 2, 4, 3})},
                 [](const Inputs& x) {
                   return scaled_dot_product_attention(x[0], x[1], x[2], {.causal = true});
                 }});
  all.push_back({"scaled_dot_product_attention",
                 {any({2, 1, 3, 2}), any({2, 1, 4, 2}), any({2, 1, 4, 3}), any({3, 4})},
                 [](const Inputs& x) {  // an additive mask, differentiated (broadcast over B, H)
                   return scaled_dot_product_attention(x[0], x[1], x[2], {.mask = x[3]});
                 }});
  all.push_back({"scaled_dot_product_attention",
                 {any({1, 2, 3, 2}), any({1, 2, 4, 2}), any({1, 2, 4, 2})},
                 [](const Inputs& x) {
                   Tensor allowed = from_vector<uint8_t>({1, 0, 1, 1, 0, 1, 1, 0, 1, 1, 1, 0},
                                                         {1, 1, 3, 4}, x[0].device())
                                        .to(kBool);
                   return scaled_dot_product_attention(x[0], x[1], x[2], {.mask = allowed});
                 }});
  all.push_back({"scaled_dot_product_attention",
                 {any({1, 2, 4, 3}), any({1, 2, 4, 3}), any({1, 2, 4, 3})},
                 [](const Inputs& x) {
                   Generator g(11);  // the same dropout mask at every perturbation
                   return scaled_dot_product_attention(
                       x[0], x[1], x[2], {.causal = true, .dropout_p = 0.3, .generator = &g});
                 }});
  // Rotary: both pair layouts, positions [T] and [B, T], a partial head, a strided view.
  all.push_back({"rotary_embedding", {any({2, 3, 2, 4})}, [](const Inputs& x) {
                   Tensor at = from_vector<int64_t>({5, 0, 2}, {3}, x[0].device());
                   return rotary_embedding(x[0], at);
                 }});
  all.push_back({"rotary_embedding", {any({2, 3, 1, 6})}, [](const Inputs& x) {
                   Tensor at = from_vector<int64_t>({0, 1, 2, 7, 0, 1}, {2, 3}, x[0].device());
                   return rotary_embedding(x[0], at,
                                           {.base = 100, .interleaved = true, .rotary_dim = 4});
                 }});
  all.push_back({"rotary_embedding", {any({1, 2, 4, 4})}, [](const Inputs& x) {
                   Tensor at = from_vector<int64_t>({3, 9, 1, 4}, {4}, x[0].device());
                   return rotary_embedding(x[0].transpose(1, 2), at, {.base = 50});
                 }});
  all.push_back({"packed_qkv_attention", {any({2, 3, 2, 3, 4})}, [](const Inputs& x) {
                   return packed_qkv_attention(x[0], {.causal = true, .scale = 0.8});
                 }});
  all.push_back({"tril", {any({3, 4})}, [](const Inputs& x) { return tril(x[0]).exp(); }});
  all.push_back({"tril", {tr({2, 4})}, [](const Inputs& x) { return tril(x[0], 1).exp(); }});
  all.push_back({"triu", {any({2, 3, 3})}, [](const Inputs& x) { return triu(x[0], -1).exp(); }});
  all.push_back({"masked_fill", {any({3, 4})}, [](const Inputs& x) {
                   return masked_fill(x[0], gt(x[0], scalar_tensor(0.2, {.device = x[0].device()})),
                                      -2.0)
                       .exp();
                 }});
  all.push_back(
      {"topk", {any({3, 5})}, [](const Inputs& x) { return topk(x[0], 2).values.exp(); }});
  all.push_back(
      {"topk", {tr({4, 3})}, [](const Inputs& x) { return topk(x[0], 3, 0, false).values.exp(); }});
  all.push_back(
      {"embedding", {any({6, 3})}, [](const Inputs& x) {
         return embedding(x[0], from_vector<int64_t>({5, 0, 5, 1, 2, 3}, {2, 3}, x[0].device()));
       }});
  all.push_back({"dropout", {any({4, 5})}, [](const Inputs& x) {
                   Generator g(
                       7);  // a fresh generator per call: the same mask at every perturbation
                   return dropout(x[0], 0.4, true, &g);
                 }});
  all.push_back({"clone", {tr({3, 4})}, [](const Inputs& x) { return x[0].clone() * x[0]; }});
  all.push_back(
      {"contiguous", {tr({3, 4})}, [](const Inputs& x) { return x[0].contiguous().exp(); }});
  all.push_back({"to_dtype",
                 {any({3, 4})},
                 [](const Inputs& x) { return x[0].to(kFloat32).to(kFloat64) * x[0]; },
                 1e-2});
  all.push_back({"add_", {any({3, 4}), any({4})}, [](const Inputs& x) {
                   Tensor y = x[0] * 2.0;
                   y.add_(x[1], 0.5);
                   return y * y;
                 }});
  all.push_back({"mul_", {any({3, 4}), any({3, 4})}, [](const Inputs& x) {
                   Tensor y = x[0] * 2.0;  // (exp would save its output, which mul_ overwrites)
                   y.mul_(x[1]);
                   return y;
                 }});
  all.push_back({"copy_", {any({3, 4}), any({4})}, [](const Inputs& x) {
                   Tensor z = zeros({3, 4}, {.dtype = kFloat64, .device = x[0].device()});
                   z.copy_(x[1]);  // z takes x[1]'s history, broadcast over rows
                   return x[0] * z;
                 }});
  all.push_back({"custom_function", {any({3, 4})}, [](const Inputs& x) {
                   struct Cube : autograd::Function<Cube> {
                     static Tensor forward(autograd::FunctionContext& ctx, const Tensor& v) {
                       ctx.save_for_backward({v});
                       return v * v * v;
                     }
                     static std::vector<Tensor> backward(autograd::FunctionContext& ctx,
                                                         const std::vector<Tensor>& g) {
                       Tensor v = ctx.saved()[0];
                       return {g[0] * 3.0 * v * v};
                     }
                   };
                   return Cube::apply(x[0]);
                 }});
  return all;
}

std::vector<bool> to_vector_bool(const Tensor& t) {
  std::vector<bool> out;
  for (uint8_t v : t.to(kUInt8).to_vector<uint8_t>()) out.push_back(v != 0);
  return out;
}

std::vector<Tensor> weave::test::make_inputs(const std::vector<Input>& specs,
                                             Generator& generator) {
  std::vector<Tensor> inputs;
  for (const Input& spec : specs) {
    Shape storage_shape = spec.shape;
    if (spec.transposed) std::swap(storage_shape[0], storage_shape[1]);
    Tensor t = randn(storage_shape, {.dtype = kFloat64}, &generator);
    if (spec.domain == Domain::Positive) t = abs(t) + 0.5;
    if (spec.domain == Domain::Unit) t = tanh(t) * 0.9;
    if (spec.transposed) t = t.transpose(0, 1);
    inputs.push_back(t.detach().requires_grad_());
  }
  return inputs;
}

TEST_SUITE("op_table") {
  TEST_CASE("every differentiable op matches finite differences") {
    std::set<std::string> ops;
    int index = 0;
    for (const OpCase& c : op_cases()) {
      Generator generator(1000 + index++);
      std::vector<Tensor> inputs = make_inputs(c.inputs, generator);
      bool any_transposed = false;
      for (const Input& in : c.inputs) any_transposed = any_transposed || in.transposed;
      if (any_transposed) {
        bool noncontiguous = false;
        for (const Tensor& t : inputs) noncontiguous = noncontiguous || !t.is_contiguous();
        CHECK_MESSAGE(noncontiguous, c.op, ": transposed input should be non-contiguous");
      }
      autograd::GradcheckResult result = autograd::gradcheck(c.fn, inputs, {.eps = c.eps});
      CHECK_MESSAGE(result.ok, c.op, " case ", index, ": ", result.report);
      CHECK(result.checked > 0);
      ops.insert(c.op);
    }
    MESSAGE("gradcheck table: " << ops.size() << " ops in " << index << " cases");
    fmt::print("gradcheck table covered {} ops in {} cases\n", ops.size(), index);
  }

  TEST_CASE("every listed differentiable op has a row") {
    std::set<std::string> rows;
    for (const OpCase& c : op_cases()) rows.insert(c.op);
    std::vector<std::string> listed;
#define WEAVE_LISTED_UNARY(Name, Functor, function) listed.push_back(#function);
    WEAVE_UNARY_OPS(WEAVE_LISTED_UNARY)
#undef WEAVE_LISTED_UNARY
#define WEAVE_LISTED(function) listed.push_back(#function);
    WEAVE_DIFFERENTIABLE_BINARY_OPS(WEAVE_LISTED)
    WEAVE_DIFFERENTIABLE_OTHER_OPS(WEAVE_LISTED)
#undef WEAVE_LISTED
    for (const std::string& op : listed)
      CHECK_MESSAGE(rows.count(op) == 1, "op '", op, "' has no row in the op table");
    // Every arithmetic functor has its front end in the binary list (so it gets rows too).
    int arithmetic = 0, binary = 0;
#define WEAVE_COUNT_FUNCTOR(Name, Functor) ++arithmetic;
    WEAVE_ARITHMETIC_OPS(WEAVE_COUNT_FUNCTOR)
#undef WEAVE_COUNT_FUNCTOR
#define WEAVE_COUNT_FRONT_END(function) ++binary;
    WEAVE_DIFFERENTIABLE_BINARY_OPS(WEAVE_COUNT_FRONT_END)
#undef WEAVE_COUNT_FRONT_END
    CHECK_MESSAGE(arithmetic == binary,
                  "WEAVE_ARITHMETIC_OPS and WEAVE_DIFFERENTIABLE_BINARY_OPS differ in length");
    MESSAGE(listed.size() << " listed ops, each with a row");
  }

  TEST_CASE("NaN propagates through every elementwise op and reduction, as in PyTorch") {
    const double nan = std::nan("");
    for (DType dtype : {kFloat32, kFloat64, kBFloat16}) {
      CAPTURE(dtype);
      // A NaN among ordinary values, at the front, in the middle and at the end.
      Tensor x = from_vector<double>({nan, -1.5, 0.0, nan, 2.0, nan}).to(dtype);
      auto nan_where_x_is = [&](const Tensor& y, const std::string& op) {
        const auto v = y.to(kFloat64).to_vector<double>();
        const auto in = x.to(kFloat64).to_vector<double>();
        REQUIRE(v.size() == in.size());
        for (size_t i = 0; i < v.size(); ++i)  // (log(-1.5) is NaN too: NaN in implies NaN out)
          if (std::isnan(in[i])) CHECK_MESSAGE(std::isnan(v[i]), op, " element ", i, " is ", v[i]);
      };
#define WEAVE_NAN_UNARY(Name, Functor, function) nan_where_x_is(function(x), #function);
      WEAVE_UNARY_OPS(WEAVE_NAN_UNARY)
#undef WEAVE_NAN_UNARY
      Tensor one = ones({6}, {.dtype = dtype});
      // Every arithmetic op, NaN on either side (pow(NaN, 0) = 1 is IEEE's and PyTorch's).
#define WEAVE_NAN_BINARY(function)                            \
  nan_where_x_is(function(x, one * 0.5), #function "(x, c)"); \
  nan_where_x_is(function(one * 0.5, x), #function "(c, x)");
      WEAVE_DIFFERENTIABLE_BINARY_OPS(WEAVE_NAN_BINARY)
#undef WEAVE_NAN_BINARY
      nan_where_x_is(clamp(x, -1.0, 1.0), "clamp");
      nan_where_x_is(clamp(x, 0.0), "clamp(min)");
      nan_where_x_is(where(gt(one, zeros_like(one)), x, one), "where");
      nan_where_x_is(x * 2.0 + 1.0, "scalar ops");
      CHECK(to_vector_bool(isnan(x)) == std::vector<bool>{true, false, false, true, false, true});
      CHECK(to_vector_bool(isfinite(x)) ==
            std::vector<bool>{false, true, true, false, true, false});
      // Comparisons with NaN are false (ne: true), as IEEE says.
      CHECK(to_vector_bool(gt(x, one * -10.0)) ==
            std::vector<bool>{false, true, true, false, true, false});
      CHECK(to_vector_bool(ne(x, x)) == to_vector_bool(isnan(x)));
      // Reductions: max/min/sum/mean are NaN; argmax/argmin point at the first NaN.
      for (Tensor r : {max(x), min(x), sum(x), mean(x), softmax(x).sum()})
        CHECK(std::isnan(r.to(kFloat64).item<double>()));
      CHECK(argmax(x).item<int64_t>() == 0);
      CHECK(argmin(x.narrow(0, 1, 5)).item<int64_t>() == 2);
      CHECK_FALSE(all_finite(x));
      CHECK(all_finite(x.narrow(0, 1, 2)));
      CHECK_FALSE(all_finite(full({3}, INFINITY, {.dtype = dtype})));
      CHECK(all_finite(full({1000}, 3e38, {.dtype = kFloat32})));  // no overflow in the test
    }
    // The gradient of relu at NaN is NaN (visible), not a silent 0.
    Tensor x = from_vector<double>({std::nan(""), 1.0}).requires_grad_();
    relu(x).sum().backward();
    CHECK(std::isnan(x.grad().to_vector<double>()[0]));
    CHECK(x.grad().to_vector<double>()[1] == 1.0);
    CHECK(sign(from_vector<double>({-3, 0, 2})).to_vector<double>() ==
          std::vector<double>{-1, 0, 1});
    CHECK(sign(from_vector<int64_t>({-3, 0, 2})).to_vector<int64_t>() ==
          std::vector<int64_t>{-1, 0, 1});
    CHECK(clamp(from_vector<int64_t>({-3, 0, 2}), -1.0, 1.0).to_vector<int64_t>() ==
          std::vector<int64_t>{-1, 0, 1});
    CHECK_WEAVE_ERROR(clamp(x, 1.0, -1.0), "clamp", "min 1 is above max -1");
    CHECK_WEAVE_ERROR(clamp(x, std::nan("")), "clamp", "a bound is NaN");
    CHECK_WEAVE_ERROR(clamp(x, std::nullopt, std::nullopt), "clamp", "found neither");
  }

  TEST_CASE("gather, take_along_dim and square give PyTorch's values and refuse bad indices") {
    const Tensor x = from_vector<double>({1, 2, 3, 4, 5, 6}, {2, 3});
    // torch.gather(x, 1, [[0, 0], [2, 1]]) and torch.gather(x, 0, [[1, 0, 1]])
    CHECK(gather(x, 1, from_vector<int64_t>({0, 0, 2, 1}, {2, 2})).to_vector<double>() ==
          std::vector<double>{1, 1, 6, 5});
    CHECK(gather(x, 0, from_vector<int64_t>({1, 0, 1}, {1, 3})).to_vector<double>() ==
          std::vector<double>{4, 2, 6});
    CHECK(gather(x, -1, from_vector<int32_t>({-1, -3}, {2, 1})).to_vector<double>() ==
          std::vector<double>{3, 4});
    const Tensor best = take_along_dim(x, argmax(x, 1, true), 1);  // each row's largest
    CHECK(best.shape() == Shape{2, 1});
    CHECK(best.to_vector<double>() == std::vector<double>{3, 6});
    CHECK(square(from_vector<int64_t>({-3, 0, 2})).to_vector<int64_t>() ==
          std::vector<int64_t>{9, 0, 4});
    CHECK_WEAVE_ERROR(gather(x, 1, from_vector<int64_t>({3}, {1, 1})), "gather",
                      "index out of range for dimension 1 of size 3: found [3, 3]");
    CHECK_WEAVE_ERROR(gather(x, 1, from_vector<int64_t>({0, 1})), "gather", "x's 2 dims");
    CHECK_WEAVE_ERROR(gather(x, 1, zeros({3, 1}, {.dtype = kInt64})), "gather",
                      "exceeds x's shape");
    CHECK_WEAVE_ERROR(gather(x, 1, zeros({2, 1})), "gather", "int32 or int64");
    CHECK_WEAVE_ERROR(take_along_dim(x, zeros({3, 1}, {.dtype = kInt64}), 1), "take_along_dim",
                      "broadcast");
  }

  TEST_CASE("gradcheck catches a wrong derivative") {
    struct WrongSquare : autograd::Function<WrongSquare> {
      static Tensor forward(autograd::FunctionContext& ctx, const Tensor& v) {
        ctx.save_for_backward({v});
        return v * v;
      }
      static std::vector<Tensor> backward(autograd::FunctionContext& ctx,
                                          const std::vector<Tensor>& g) {
        return {g[0] * ctx.saved()[0]};  // missing the factor 2
      }
    };
    Tensor x = randn({3}, {.dtype = kFloat64}).requires_grad_();
    auto result =
        autograd::gradcheck([](const Inputs& in) { return WrongSquare::apply(in[0]); }, {x});
    CHECK_FALSE(result.ok);
    CHECK(result.report.find("analytic") != std::string::npos);
  }
}
