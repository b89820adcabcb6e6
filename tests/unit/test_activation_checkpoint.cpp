// Activation checkpointing against the plain run (gradients bitwise equal, dropout and autocast
// included), what it frees and recomputes, selective keeping, nesting, its errors; module
// forward hooks.
#include <map>
#include <memory>

#include "helpers.h"

using namespace weave;

namespace {

Tensor squared_sum(const Tensor& t) {
  return sum(t * t);
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.defined() && b.defined() && a.shape() == b.shape() && a.dtype() == b.dtype() &&
         max(abs(a.to(kFloat64) - b.to(kFloat64))).item<double>() == 0.0;
}

// Two transformer blocks with dropout and a head: float64 unless `dtype` says otherwise.
struct Model {
  std::vector<std::shared_ptr<nn::TransformerBlock>> blocks;
  std::shared_ptr<nn::Linear> head;
  explicit Model(DType dtype = kFloat64) {
    Generator init(11);
    for (int i = 0; i < 2; ++i)
      blocks.push_back(std::make_shared<nn::TransformerBlock>(
          8, 2, nn::TransformerBlockOptions{.hidden = 16, .dropout = 0.25}));
    head = std::make_shared<nn::Linear>(8, 5);
    NoGradGuard no_grad;
    for (Tensor& p : parameters()) p.copy_(randn(p.shape(), {}, &init) * 0.3);
    for (auto& b : blocks) b->to(dtype);
    head->to(dtype);
  }
  std::vector<Tensor> parameters() const {
    std::vector<Tensor> out;
    for (auto& b : blocks)
      for (Tensor& p : b->parameters()) out.push_back(p);
    for (Tensor& p : head->parameters()) out.push_back(p);
    return out;
  }
};

// The loss's gradients (input first, then every parameter) of one step from `seed`; `block`
// runs a block (plainly or checkpointed).
template <class RunBlock>
std::vector<Tensor> gradients(Model& model, const Tensor& x_value, RunBlock&& block) {
  manual_seed(99);
  Tensor x = x_value.detach().requires_grad_(true);
  Tensor h = x;
  for (auto& b : model.blocks) h = block(*b, h);
  squared_sum((*model.head)(h).to(kFloat64)).backward();
  std::vector<Tensor> grads{x.grad()};
  for (Tensor& p : model.parameters()) {
    grads.push_back(p.grad());
    p.set_grad({});
  }
  return grads;
}

void check_all_bitwise(const std::vector<Tensor>& got, const std::vector<Tensor>& expected) {
  REQUIRE(got.size() == expected.size());
  for (size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    CHECK(bitwise_equal(got[i], expected[i]));
  }
}

}  // namespace

TEST_SUITE("activation_checkpoint") {
  TEST_CASE("checkpointed blocks give the plain run's gradients bitwise, dropout included") {
    Model model;
    const Tensor x = randn({3, 6, 8}, {.dtype = kFloat64});
    auto plain = [](nn::Module& b, const Tensor& h) { return b(h); };
    const std::vector<Tensor> expected = gradients(model, x, plain);
    // dropout is on: without the generator's replay the recomputed masks would differ
    const std::vector<Tensor> other_seed = [&] {
      manual_seed(1);
      Tensor xx = x.detach().requires_grad_(true);
      Tensor h = xx;
      for (auto& b : model.blocks) h = (*b)(h);
      squared_sum((*model.head)(h)).backward();
      std::vector<Tensor> g{xx.grad()};
      for (Tensor& p : model.parameters()) p.set_grad({});
      return g;
    }();
    CHECK_FALSE(bitwise_equal(other_seed[0], expected[0]));

    for (const std::vector<std::string>& keep :
         {std::vector<std::string>{}, std::vector<std::string>{"matmul"}}) {
      CAPTURE(keep.size());
      const int64_t reused_before = autograd::detail::reused_results();
      auto checkpointed = [&](nn::Module& b, const Tensor& h) {
        return autograd::checkpoint([&b](const Tensor& in) { return b(in); }, h, {.keep = keep});
      };
      check_all_bitwise(gradients(model, x, checkpointed), expected);
      // each block's products: q/k/v, out, fc1, fc2 (its bias_gelu keeps fc1's plain product)
      const int64_t reused = autograd::detail::reused_results() - reused_before;
      if (keep.empty())
        CHECK(reused == 0);
      else
        CHECK(reused == 2 * 4);
    }
  }

  TEST_CASE("a region's activations are freed after forward and recomputed once in backward") {
    Tensor w = (randn({16, 16}, {.dtype = kFloat64}) * 0.2).requires_grad_(true);
    std::weak_ptr<Storage> inner;
    int calls = 0;
    auto region = [&](const Tensor& x) {
      ++calls;
      Tensor h = tanh(matmul(x, w));  // tanh saves its output h
      if (calls == 1) inner = h.storage();
      return sum(exp(matmul(h, w)), {1});
    };
    const Tensor x = randn({4, 16}, {.dtype = kFloat64});
    // plain: h stays alive, saved by tanh's and the product's backward
    Tensor plain = region(x);
    CHECK_FALSE(inner.expired());
    sum(plain).backward();
    const Tensor expected = w.grad().clone();
    w.set_grad({});
    plain = Tensor();

    calls = 0;
    Tensor out = autograd::checkpoint(region, x);
    CHECK(calls == 1);
    CHECK(inner.expired());  // nothing in the graph holds it
    sum(out).backward();
    CHECK(calls == 2);  // recomputed once, for all of the region's nodes
    CHECK(bitwise_equal(w.grad(), expected));
  }

  TEST_CASE("nested regions, several inputs and outputs, nn::Checkpoint keeps the names") {
    Model model;
    const Tensor x = randn({2, 5, 8}, {.dtype = kFloat64});
    const std::vector<Tensor> expected =
        gradients(model, x, [](nn::Module& b, const Tensor& h) { return b(h); });
    // both blocks in one region, each also its own region inside it
    Tensor xx = x.detach().requires_grad_(true);
    manual_seed(99);
    auto both = [&](const std::vector<Tensor>& in) {
      Tensor h = in[0];
      for (auto& b : model.blocks)
        h = autograd::checkpoint([&b](const Tensor& t) { return (*b)(t); }, h);
      return std::vector<Tensor>{h, in[1] * 2.0};
    };
    Tensor side = full({1}, 3.0, {.dtype = kFloat64}).requires_grad_(true);
    std::vector<Tensor> outs = autograd::checkpoint(both, {xx, side});
    REQUIRE(outs.size() == 2);
    (squared_sum((*model.head)(outs[0])) + sum(outs[1])).backward();
    std::vector<Tensor> got{xx.grad()};
    for (Tensor& p : model.parameters()) {
      got.push_back(p.grad());
      p.set_grad({});
    }
    check_all_bitwise(got, expected);
    CHECK(side.grad().item<double>() == 2.0);

    std::map<nn::Module*, std::shared_ptr<nn::Checkpoint>> wrappers;
    for (auto& b : model.blocks) wrappers[b.get()] = std::make_shared<nn::Checkpoint>(b);
    check_all_bitwise(
        gradients(model, x, [&](nn::Module& b, const Tensor& h) { return (*wrappers.at(&b))(h); }),
        expected);
    // the wrapper adds no name
    const nn::NamedTensors inner = model.blocks[0]->named_parameters();
    nn::Sequential seq{wrappers.at(model.blocks[0].get())};
    const nn::NamedTensors outer = seq.named_parameters();
    REQUIRE(inner.size() == outer.size());
    for (size_t i = 0; i < inner.size(); ++i) CHECK(outer[i].first == "0." + inner[i].first);
  }

  TEST_CASE("autocast inside a region is replayed by the recomputation") {
    Model model(kFloat32);
    const Tensor x = randn({2, 4, 8});
    auto run = [&](bool checkpointed) {
      AutocastGuard autocast(kBFloat16);
      return gradients(model, x, [&](nn::Module& b, const Tensor& h) {
        if (!checkpointed) return b(h);
        return autograd::checkpoint([&b](const Tensor& in) { return b(in); }, h);
      });
    };
    const std::vector<Tensor> expected = run(false);
    CHECK(expected[1].dtype() == kFloat32);
    check_all_bitwise(run(true), expected);
  }

  TEST_CASE("bad uses raise clear errors") {
    Tensor w = randn({3, 3}, {.dtype = kFloat64}).requires_grad_(true);
    Tensor x = randn({2, 3}, {.dtype = kFloat64}).requires_grad_(true);
    // the output ignores the input: its gradient would silently be zero
    CHECK_WEAVE_ERROR(autograd::checkpoint([&](const Tensor&) { return w * 2.0; }, x), "checkpoint",
                      "depends on its inputs");
    // nothing requires grad
    CHECK_WEAVE_ERROR(autograd::checkpoint([](const Tensor& t) { return t * 2.0; }, x.detach()),
                      "checkpoint", "requires grad");
    CHECK_WEAVE_ERROR(
        autograd::checkpoint([](const Tensor& t) { return t; }, x, {.keep = {"gelu"}}),
        "checkpoint", "expected one of: matmul");
    {  // an input modified in place before backward
      Tensor input = randn({2, 3}, {.dtype = kFloat64});
      Tensor out = autograd::checkpoint([&](const Tensor& t) { return exp(matmul(t, w)); }, input);
      {
        NoGradGuard no_grad;
        input.mul_(2.0);
      }
      CHECK_WEAVE_ERROR(sum(out).backward(), "checkpoint", "input 0");
    }
    {  // a function that does other work when recomputed
      int calls = 0;
      Tensor out = autograd::checkpoint(
          [&](const Tensor& t) {
            Tensor y = exp(matmul(t, w));
            return ++calls == 1 ? y : exp(y);
          },
          x);
      CHECK_WEAVE_ERROR(sum(out).backward(), "checkpoint", "diverged");
    }
    w.set_grad({});
    x.set_grad({});
  }

  TEST_CASE("memory_stats counts bytes in use, the peak, live blocks and the cache") {
    reset_peak_memory();
    const MemoryStats before = memory_stats();
    CHECK(before.peak == before.in_use);
    {
      Tensor t = empty({1 << 16}, {.dtype = kFloat64});  // 512 KiB: a cached size
      const MemoryStats during = memory_stats();
      CHECK(during.in_use == before.in_use + (size_t(1) << 19));
      CHECK(during.allocations == before.allocations + 1);
      CHECK(during.peak >= during.in_use);
    }
    const MemoryStats after = memory_stats();
    CHECK(after.in_use == before.in_use);
    CHECK(after.allocations == before.allocations);
    CHECK(after.peak >= before.in_use + (size_t(1) << 19));
    CHECK(after.cached >= (size_t(1) << 19));  // the block waits for reuse
    reset_peak_memory();
    CHECK(memory_stats().peak == after.in_use);
    if (cuda::is_available())  // the device's own counters (cuda_kernels checks them in use)
      CHECK(memory_stats(Device::cuda(0)).peak >= memory_stats(Device::cuda(0)).in_use);
    else
      CHECK_THROWS_AS(memory_stats(Device::cuda(0)), Error);
  }

  TEST_CASE("memory_stats reads the process's resident set and its peak, which a reset restarts") {
    cpu_empty_cache();
    reset_peak_memory();
    const ProcessMemory before = process_memory();
    REQUIRE(before.resident > 0);
    CHECK(before.resident_peak >= before.resident);
    CHECK(before.mapped >= before.resident);
    constexpr size_t kBytes = size_t(64) << 20;
    {
      Tensor t = ones({int64_t(kBytes / 8)}, {.dtype = kFloat64});  // touched: resident
      const MemoryStats during = memory_stats();
      CHECK(during.resident >= before.resident + kBytes * 9 / 10);
      CHECK(during.resident_peak >= during.resident);
    }
    cpu_empty_cache();  // the block goes back (to the system, or a sanitizer's quarantine)
    const ProcessMemory after = process_memory();
    CHECK(after.resident_peak >= before.resident + kBytes * 9 / 10);
    // A reset starts the peak from what is resident now.
    reset_peak_memory();
    const ProcessMemory reset = process_memory();
    CHECK(reset.resident_peak <= reset.resident + (size_t(16) << 20));
    const std::string said = describe_process_memory();
    CHECK(said.find("resident") != std::string::npos);
    CHECK(said.find("mapped") != std::string::npos);
  }

  TEST_CASE("checkpointing every block cuts the step's peak activation memory") {
    // eight wide blocks on a long batch: activations dominate the parameters
    std::vector<std::shared_ptr<nn::TransformerBlock>> blocks;
    for (int i = 0; i < 8; ++i)
      blocks.push_back(std::make_shared<nn::TransformerBlock>(
          32, 4, nn::TransformerBlockOptions{.hidden = 128}));
    const Tensor x = randn({4, 64, 32});
    auto peak = [&](bool checkpointed) {
      const size_t base = memory_stats().in_use;
      reset_peak_memory();
      Tensor h = x;
      for (auto& b : blocks)
        h = checkpointed ? autograd::checkpoint([&b](const Tensor& t) { return (*b)(t); }, h)
                         : (*b)(h);
      sum(h * h).backward();
      for (auto& b : blocks) b->zero_grad();
      return double(memory_stats().peak - base);
    };
    peak(false);  // first-step allocations (gradients) out of the way
    const double plain = peak(false), checkpointed = peak(true);
    MESSAGE("peak above baseline: plain ", plain / 1e6, " MB, checkpointed ", checkpointed / 1e6,
            " MB");
    CHECK(checkpointed < 0.4 * plain);
  }

  // The models' recompute_blocks (set_recompute_blocks, the one switch): every block runs again in
  // backward (a pre-hook sees a second call), the logits and every gradient are bitwise the
  // plain run's, and the step's peak memory drops. Llama with packed side inputs, which the
  // recomputation must see again.
  TEST_CASE("recompute_blocks in Llama and GPT2: the same gradients, less memory") {
    const Tensor tokens = randint(0, 40, {4, 64}, {.dtype = kInt64});
    std::vector<int64_t> where, document;  // documents of 24 positions packed in each row
    for (int64_t row = 0; row < 4; ++row)
      for (int64_t t = 0; t < 64; ++t) {
        where.push_back(t % 24);
        document.push_back(t / 24);
      }
    const Tensor positions = from_vector(where, {4, 64}),
                 documents = from_vector(document, {4, 64});
    for (const std::string arch : {"llama", "gpt2"}) {
      CAPTURE(arch);
      std::vector<Tensor> logits, grads[2];
      std::vector<double> peaks;
      std::vector<int> calls;
      for (const bool recompute : {false, true}) {
        manual_seed(5);
        std::shared_ptr<nn::CausalLM> model;
        if (arch == "llama")
          model = std::make_shared<models::Llama>(
              models::LlamaOptions{.vocab = 40, .dim = 32, .layers = 4, .block = {.heads = 4}});
        else
          model = std::make_shared<models::GPT2>(models::GPT2Options{
              .vocab = 40, .dim = 32, .layers = 4, .heads = 4, .max_positions = 64});
        model->set_recompute_blocks(recompute);
        CHECK(model->recompute_blocks() == recompute);
        nn::Module& first = arch == "llama" ? (*static_cast<models::Llama&>(*model).blocks)[0]
                                            : (*static_cast<models::GPT2&>(*model).blocks)[0];
        int seen = 0;
        auto handle = first.register_forward_pre_hook([&](nn::Module&, const Tensor&) {
          ++seen;
          return Tensor();
        });
        for (int step = 0; step < 2; ++step) {  // the first allocates the gradients
          model->zero_grad();
          seen = 0;
          const size_t base = memory_stats().in_use;
          reset_peak_memory();
          const Tensor out =
              arch == "llama" ? (*model)({tokens, positions, documents}) : (*model)(tokens);
          cross_entropy(out.reshape({-1, 40}), tokens.reshape({-1})).backward();
          if (step == 1) {
            peaks.push_back(double(memory_stats().peak - base));
            logits.push_back(out.detach());
          }
        }
        handle.remove();
        calls.push_back(seen);
        for (const Tensor& p : model->parameters()) grads[recompute].push_back(p.grad().clone());
      }
      CHECK(calls == std::vector<int>{1, 2});
      CHECK(bitwise_equal(logits[1], logits[0]));
      REQUIRE(grads[1].size() == grads[0].size());
      for (size_t i = 0; i < grads[0].size(); ++i) CHECK(bitwise_equal(grads[1][i], grads[0][i]));
      MESSAGE(arch, " step peak above what it began with: plain ", peaks[0] / 1e6,
              " MB, recompute_blocks ", peaks[1] / 1e6, " MB");
      CHECK(peaks[1] < 0.7 * peaks[0]);
    }
  }

  TEST_CASE("module forward hooks: pre replaces the input, post the output, handles remove") {
    auto layer = std::make_shared<nn::Linear>(3, 2);
    const Tensor x = randn({4, 3});
    const Tensor plain = (*layer)(x);
    std::vector<std::string> order;
    HookHandle pre = layer->register_forward_pre_hook([&](nn::Module& m, const Tensor& in) {
      order.push_back("pre " + m.name());
      return in * 2.0;
    });
    HookHandle post =
        layer->register_forward_hook([&](nn::Module&, const Tensor& in, const Tensor& out) {
          order.push_back("post");
          CHECK(bitwise_equal(in, x * 2.0));
          return out + 1.0;
        });
    HookHandle watch = layer->register_forward_hook([&](nn::Module&, const Tensor&, const Tensor&) {
      order.push_back("watch");
      return Tensor();  // keeps the output
    });
    nn::Sequential seq{layer};  // containers call their children with the hooks
    const Tensor hooked = seq(x);
    CHECK(order == std::vector<std::string>{"pre Linear", "post", "watch"});
    CHECK(test::close(hooked, layer->forward(x * 2.0) + 1.0));
    CHECK(order.size() == 3);  // forward() itself runs no hooks
    pre.remove();
    post.remove();
    watch.remove();
    CHECK(bitwise_equal(seq(x), plain));
    CHECK(order.size() == 3);
  }
}
