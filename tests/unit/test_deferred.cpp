// Deferred initialization on one process: the counter-based generator against Philox's
// published answers, parameters without memory, and slices drawn alone equal to the whole.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <optional>

#include "weave/weave.h"

using namespace weave;

namespace {

models::LlamaOptions tiny_llama() {
  return {.vocab = 37, .dim = 16, .layers = 2, .block = {.heads = 4, .kv_heads = 2, .hidden = 24}};
}

bool bit_equal(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         std::memcmp(a.contiguous().data_ptr(), b.contiguous().data_ptr(),
                     size_t(a.numel()) * a.itemsize()) == 0;
}

}  // namespace

TEST_SUITE("deferred") {
  TEST_CASE("Philox4x32-10 gives the known answers of its authors' test vectors") {
    using W = std::array<uint32_t, 4>;
    CHECK(philox4x32({0, 0, 0, 0}, {0, 0}) == W{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8});
    CHECK(philox4x32({0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff}) ==
          W{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd});
    CHECK(philox4x32({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0}) ==
          W{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1});
  }

  TEST_CASE("counter draws have the moments of their distributions") {
    const uint64_t key = stream_key(3, "w");
    double sum = 0, squares = 0, usum = 0;
    const int n = 200000;
    for (int i = 0; i < n; ++i) {
      const double z = counter_normal(key, uint64_t(i)), u = counter_uniform(key, uint64_t(i));
      sum += z;
      squares += z * z;
      usum += u;
      REQUIRE((u >= 0 && u < 1));
    }
    CHECK(std::abs(sum / n) < 0.01);
    CHECK(std::abs(squares / n - 1) < 0.01);
    CHECK(std::abs(usum / n - 0.5) < 0.005);
    CHECK(stream_key(3, "w") != stream_key(4, "w"));
    CHECK(stream_key(3, "w") != stream_key(3, "v"));
  }

  TEST_CASE("a model built under DeferredInit allocates nothing and raises on use, naming it") {
    reset_peak_memory();
    const size_t before = memory_stats().in_use;
    std::shared_ptr<models::Llama> model;
    {
      nn::DeferredInit deferred(5);
      model = std::make_shared<models::Llama>(tiny_llama());
    }
    model->to(kFloat64);
    CHECK(memory_stats().in_use - before < 4096);  // buffers (rotary tables) only
    CHECK(nn::has_deferred(*model));
    for (const auto& [name, p] : model->named_parameters()) {
      CHECK(nn::is_deferred(p));
      CHECK(p.dtype() == kFloat64);
    }
    const Tensor ids = from_vector(std::vector<int64_t>{1, 2, 3}, {1, 3});
    try {
      (*model)(ids);
      FAIL("a deferred model ran");
    } catch (const Error& e) {
      CHECK(std::string(e.what()).find("nn::DeferredInit") != std::string::npos);
      // named as the model names it, not by the layer's class ("Embedding.weight")
      CHECK(std::string(e.what()).find("'embedding.weight'") != std::string::npos);
    }
    nn::materialize(*model);
    CHECK_FALSE(nn::has_deferred(*model));
    CHECK((*model)(ids).shape() == Shape{1, 3, 37});
  }

  TEST_CASE("values depend on the seed and the name, and follow the model's own init") {
    auto build = [](uint64_t seed) {
      nn::DeferredInit deferred(seed);
      auto model = std::make_shared<models::Llama>(tiny_llama());
      for (auto& [name, p] : model->named_parameters())
        if (name.ends_with("proj.weight")) nn::init::normal_(p, 0, 0.02);
      nn::materialize(*model);
      return model;
    };
    auto a = build(5), b = build(5), c = build(6);
    const auto pa = a->named_parameters(), pb = b->named_parameters(), pc = c->named_parameters();
    for (size_t i = 0; i < pa.size(); ++i) {
      CAPTURE(pa[i].first);
      CHECK(bit_equal(pa[i].second, pb[i].second));
      if (pa[i].first.find("norm") == std::string::npos)
        CHECK_FALSE(bit_equal(pa[i].second, pc[i].second));
      if (pa[i].first.ends_with("proj.weight")) {
        const double std = pa[i].second.to(kFloat64).pow(2).mean().item<double>();
        CHECK(std::sqrt(std) == doctest::Approx(0.02).epsilon(0.15));
      }
      if (pa[i].first.find("norm") != std::string::npos)
        CHECK(bit_equal(pa[i].second, ones_like(pa[i].second)));
    }
    // Two parameters of one shape (block 0's and block 1's) draw different values: their
    // names key the streams.
    int compared = 0;
    for (size_t i = 0; i < pa.size(); ++i)
      for (size_t j = i + 1; j < pa.size(); ++j)
        if (pa[i].second.shape() == pa[j].second.shape() &&
            pa[i].first.find("norm") == std::string::npos) {
          CHECK_FALSE(bit_equal(pa[i].second, pa[j].second));
          ++compared;
        }
    CHECK(compared > 0);
  }

  TEST_CASE("any range or slice of a deferred tensor draws what the whole holds there") {
    Tensor whole, slice;
    {
      nn::DeferredInit deferred(11);
      whole = nn::init::uniform_parameter({6, 10}, -1, 1);
    }
    CHECK(nn::is_deferred(whole));
    Tensor all = empty({60}), part = empty({17});
    nn::draw_deferred(whole, "w", 0, all);
    nn::draw_deferred(whole, "w", 23, part);
    CHECK(bit_equal(part, all.narrow(0, 23, 17)));
    // Columns 4..7 of rows 0..5 (a tensor-parallel split along axis 1).
    slice = nn::deferred_copy(whole.narrow(1, 4, 3));
    Tensor drawn = empty({18});
    nn::draw_deferred(slice, "w", 0, drawn);
    CHECK(bit_equal(drawn.reshape({6, 3}), all.reshape({6, 10}).narrow(1, 4, 3).contiguous()));
    // Padded rows are zeros.
    Tensor padded = nn::deferred_pad_rows(whole, 8), rows = empty({80});
    nn::draw_deferred(padded, "w", 0, rows);
    CHECK(bit_equal(rows.narrow(0, 0, 60), all));
    CHECK(bit_equal(rows.narrow(0, 60, 20), zeros({20})));
    // A float64 copy draws the same doubles the float32 one rounds.
    Tensor wide = nn::deferred_to(whole, kFloat64, kCPU),
           doubles = empty({60}, {.dtype = kFloat64});
    nn::draw_deferred(wide, "w", 0, doubles);
    CHECK(bit_equal(doubles.to(kFloat32), all));
  }

  TEST_CASE("init's distributions refuse what has none, eager and deferred") {
    const double nan = std::nan("");
    Tensor t = empty({3});
    for (int deferred = 0; deferred < 2; ++deferred) {
      CAPTURE(deferred);
      std::optional<nn::DeferredInit> scope;
      if (deferred) scope.emplace(3);
      CHECK_THROWS_WITH_AS(nn::init::normal_parameter({3}, 0, -1),
                           doctest::Contains("a finite std >= 0"), Error);
      CHECK_THROWS_AS(nn::init::normal_parameter({3}, 0, nan), Error);
      CHECK_THROWS_AS(nn::init::normal_parameter({3}, nan, 1), Error);
      CHECK_THROWS_WITH_AS(nn::init::uniform_parameter({3}, 1, 0), doctest::Contains("low <= high"),
                           Error);
      CHECK_THROWS_AS(nn::init::uniform_parameter({3}, 0, std::numeric_limits<double>::infinity()),
                      Error);
      Tensor p = nn::init::normal_parameter({3}, 0, 1);
      CHECK_THROWS_AS(nn::init::normal_(p, 0, -0.5), Error);
      CHECK_THROWS_AS(nn::init::uniform_(p, 2, -2), Error);
      nn::init::uniform_(p, -2, 2);  // an empty range is a constant: allowed
      nn::init::uniform_(p, 1, 1);
      nn::init::normal_(p, 0, 0);
    }
    nn::init::normal_(t, 0, 0);
    CHECK(sum(abs(t)).item<double>() == 0);
  }

  TEST_CASE("a parameter remembers the seed it was drawn with, until values are loaded") {
    std::shared_ptr<models::Llama> model;
    {
      nn::DeferredInit deferred(41);
      model = std::make_shared<models::Llama>(tiny_llama());
    }
    for (const auto& [name, p] : model->named_parameters()) CHECK(nn::init_seed(p) == 41u);
    nn::materialize(*model);
    model->to(kFloat64);
    for (const auto& [name, p] : model->named_parameters()) CHECK(nn::init_seed(p) == 41u);
    model->load_state_dict(model->state_dict());  // the values are a load's now
    for (const auto& [name, p] : model->named_parameters()) CHECK_FALSE(nn::init_seed(p));
    models::Llama eager(tiny_llama());
    for (const auto& [name, p] : eager.named_parameters()) CHECK_FALSE(nn::init_seed(p));
  }
}
