// Activation checkpointing across ranks: under DDP and around tensor- and sequence-parallel
// blocks, checkpointed gradients equal the plain run's bitwise, every parameter's gradient is
// accumulated once, and no collective's backward is left pending.
#include <doctest/doctest.h>

#include <map>
#include <memory>
#include <vector>

#include "weave/weave.h"

using namespace weave;

namespace {

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.defined() && b.defined() && a.shape() == b.shape() &&
         max(abs(a - b)).item<double>() == 0.0;
}

Tensor shared_randn(const Shape& shape, uint64_t seed) {
  Generator g(seed);
  return randn(shape, {.dtype = kFloat64}, &g);
}

void randomize(nn::Module& module, uint64_t seed) {
  NoGradGuard no_grad;
  Generator g(seed);
  for (Tensor& p : module.parameters()) p.copy_(randn(p.shape(), {.dtype = kFloat64}, &g) * 0.3);
}

// Two dropout blocks and a head, float64, the same on every rank; each block checkpointed or
// not, with `keep` for selective checkpointing.
std::shared_ptr<nn::Sequential> make_model(bool checkpointed, std::vector<std::string> keep = {}) {
  auto model = std::make_shared<nn::Sequential>();
  for (int i = 0; i < 2; ++i) {
    auto block = std::make_shared<nn::TransformerBlock>(
        8, 2, nn::TransformerBlockOptions{.hidden = 16, .dropout = 0.2});
    if (checkpointed)
      model->push_back(
          std::make_shared<nn::Checkpoint>(block, autograd::CheckpointOptions{.keep = keep}));
    else
      model->push_back(block);
  }
  model->push_back(std::make_shared<nn::Linear>(8, 3));
  model->to(kFloat64);
  randomize(*model, 5);
  return model;
}

}  // namespace

TEST_SUITE("activation_checkpoint") {
  TEST_CASE("under DDP: the plain run's gradients bitwise, each hook once, nothing pending") {
    const int rank = dist::rank();
    // this rank's batch and dropout stream
    const Tensor x = shared_randn({2, 5, 8}, 100 + rank);
    auto step = [&](nn::Sequential& model) {
      parallel::DistributedDataParallel ddp(model, {.first_bucket_mb = 0.002, .bucket_mb = 0.004});
      std::map<const TensorImpl*, int> accumulated;
      std::vector<HookHandle> handles;
      for (Tensor& p : model.parameters())
        handles.push_back(p.register_post_accumulate_grad_hook(
            [&accumulated](Tensor& leaf) { ++accumulated[leaf.impl()]; }));
      manual_seed(7 + rank);
      Tensor out = ddp(x);
      sum(out * out).backward();
      for (auto& h : handles) h.remove();
      CHECK(ddp.stats().buckets > 1);  // buckets launched from inside the recomputed backward
      for (auto& [impl, count] : accumulated) CHECK(count == 1);
      CHECK(accumulated.size() == model.parameters().size());
      CHECK(autograd::must_run_pending() == 0);
      std::vector<Tensor> grads;
      for (Tensor& p : model.parameters()) grads.push_back(p.grad().clone());
      return grads;
    };
    auto plain = make_model(false);
    const std::vector<Tensor> expected = step(*plain);
    for (const std::vector<std::string>& keep :
         {std::vector<std::string>{}, std::vector<std::string>{"matmul"}}) {
      CAPTURE(keep.size());
      auto model = make_model(true, keep);
      const std::vector<Tensor> got = step(*model);
      REQUIRE(got.size() == expected.size());
      for (size_t i = 0; i < got.size(); ++i) {
        CAPTURE(i);
        CHECK(bitwise_equal(got[i], expected[i]));
      }
    }
  }

  TEST_CASE("around tensor- and sequence-parallel blocks: collectives recomputed in step") {
    const dist::Group tp = dist::world();
    const int64_t dim = 8, heads = 4, t = 4 * tp.size(), b = 2;
    if (heads % tp.size() != 0) return;  // 3 ranks: the heads do not split
    for (bool sp : {false, true}) {
      CAPTURE(sp);
      auto run = [&](bool checkpointed) {
        nn::TransformerBlock block(
            dim, heads, {.hidden = 16, .dropout = 0.2},
            {.linears = parallel::tensor_parallel(tp, {.sequence_parallel = sp})});
        block.to(kFloat64);
        randomize(block, 9 + uint64_t(tp.rank()));  // shards differ per rank
        Tensor x = shared_randn({b, t, dim}, 3);
        if (sp) x = x.narrow(1, tp.rank() * (t / tp.size()), t / tp.size()).contiguous();
        x.requires_grad_(true);
        manual_seed(21);  // replicated dropout draws the same masks on every rank
        Tensor out = checkpointed
                         ? autograd::checkpoint([&block](const Tensor& in) { return block(in); }, x)
                         : block(x);
        sum(out * out).backward();
        CHECK(autograd::must_run_pending() == 0);
        std::vector<Tensor> grads{x.grad()};
        for (Tensor& p : block.parameters()) grads.push_back(p.grad());
        return grads;
      };
      const std::vector<Tensor> expected = run(false);
      const std::vector<Tensor> got = run(true);
      REQUIRE(got.size() == expected.size());
      for (size_t i = 0; i < got.size(); ++i) {
        CAPTURE(i);
        CHECK(bitwise_equal(got[i], expected[i]));
      }
    }
  }

  TEST_CASE("a recomputation that communicates differently raises, naming both counts") {
    // The region all_reduces in forward only, as a function that branches on a step counter
    // instead of its inputs would; the recomputation then issues one collective fewer. (One
    // rank's collectives are no collectives: nothing to pair.)
    if (dist::world_size() < 2) return;
    for (bool fewer : {true, false}) {
      CAPTURE(fewer);
      int calls = 0;
      Tensor x = shared_randn({4}, 5).requires_grad_(true);
      Tensor out = autograd::checkpoint(
          [&](const Tensor& in) {
            const bool communicate = (++calls == 1) == fewer;
            Tensor h = in * in;
            return communicate ? dist::functional::all_reduce_sum(h) : h.clone();
          },
          x);
      const std::string error = [&] {
        try {
          sum(out).backward();
        } catch (const Error& e) {
          return std::string(e.what());
        }
        return std::string();
      }();
      const std::string expected = fewer ? "it issued 0 differentiable collectives, the forward 1"
                                         : "it issued 1 differentiable collectives, the forward 0";
      CHECK_MESSAGE(error.find(expected) != std::string::npos, error);
      autograd::clear_must_run();  // the failed backward left the forward's collective pending
    }
  }
}
