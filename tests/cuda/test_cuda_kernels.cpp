// The CUDA kernels that the op table's small shapes cannot reach: tensor-core attention against
// float64 attention on the CPU (plain, grouped-query and packed documents), sliding windows and
// soft-caps on every CUDA attention path, reductions split over
// many blocks, layer and RMS norm on each of their kernel paths, KV-cache decoding, the
// multi-tensor clipping and Adam kernels, binned and exact sums against the CPU bit for bit, and
// the bugs GPU runs found. Suite cuda_kernels:
// `weave_cuda_tests --test-suite=cuda_kernels --require-cuda` (skipped without a GPU).
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "helpers.h"
#include "weave/kernels/common/binned.h"
#include "weave/kernels/kernels.h"

using namespace weave;

namespace {

const Device gpu = Device::cuda(0);

/// Largest |a - b| over max(|b|) (b: the float64 reference), both moved to the CPU.
double relative_error(const Tensor& a, const Tensor& b) {
  Tensor x = a.detach().cpu().to(kFloat64), y = b.detach().cpu().to(kFloat64);
  const double scale = std::max(max(abs(y)).item<double>(), 1e-30);
  return max(abs(x - y)).item<double>() / scale;
}

struct AttentionCase {
  int64_t batch, heads, tq, tk, d;
  bool causal;
  DType dtype;
  int64_t kv_heads = 0;  // grouped-query attention when below heads; 0: heads
};

/// q, k, v of the case as strided views of one fused [B, T, 3, H, D] projection (as
/// a fused q/k/v projection makes them), or of separate tensors when tq != tk or the heads group.
std::array<Tensor, 3> attention_inputs(const AttentionCase& c, Generator& g) {
  if (c.kv_heads > 0 && c.kv_heads != c.heads)
    return {randn({c.batch, c.heads, c.tq, c.d}, {.dtype = kFloat64}, &g),
            randn({c.batch, c.kv_heads, c.tk, c.d}, {.dtype = kFloat64}, &g),
            randn({c.batch, c.kv_heads, c.tk, c.d}, {.dtype = kFloat64}, &g)};
  if (c.tq == c.tk) {
    Tensor qkv = randn({c.batch, c.tq, 3, c.heads, c.d}, {.dtype = kFloat64}, &g);
    return {qkv.select(2, 0).transpose(1, 2), qkv.select(2, 1).transpose(1, 2),
            qkv.select(2, 2).transpose(1, 2)};
  }
  return {randn({c.batch, c.heads, c.tq, c.d}, {.dtype = kFloat64}, &g),
          randn({c.batch, c.heads, c.tk, c.d}, {.dtype = kFloat64}, &g),
          randn({c.batch, c.heads, c.tk, c.d}, {.dtype = kFloat64}, &g)};
}

/// Runs the tensor-core attention on one implementation (WEAVE_ATTENTION_KERNEL) while alive:
/// cudnn fails where cuDNN declines a shape it should take, so a decline cannot pass unseen.
class AttentionKernel {
 public:
  explicit AttentionKernel(const char* name) { setenv("WEAVE_ATTENTION_KERNEL", name, 1); }
  ~AttentionKernel() { unsetenv("WEAVE_ATTENTION_KERNEL"); }
  AttentionKernel(const AttentionKernel&) = delete;
  AttentionKernel& operator=(const AttentionKernel&) = delete;
};

/// The GPU's attention result (its output, log-sum-exp and the gradients of dev) against the
/// float64 CPU one on the same rounded inputs: both outputs' backward from one random probe.
void check_attention(const AttentionResult& got, const AttentionResult& want,
                     const std::array<Tensor, 3>& dev, const std::array<Tensor, 3>& cpu,
                     DType dtype, Generator& g) {
  CHECK(relative_error(got.output, want.output) < 2e-2);
  // +inf marks a row that sees no key (tq > tk, causal): equal there, close elsewhere.
  Tensor finite = isfinite(want.logsumexp), zero = zeros({}, {.dtype = kFloat64});
  CHECK(equal(finite, isfinite(got.logsumexp.cpu())));
  CHECK(relative_error(where(finite, got.logsumexp.cpu().to(kFloat64), zero),
                       where(finite, want.logsumexp, zero)) < 1e-2);
  Tensor probe = randn(want.output.shape(), {.dtype = kFloat64}, &g);
  sum(want.output * probe).backward();
  sum(got.output * probe.to(dtype).to(gpu)).backward();
  for (int i = 0; i < 3; ++i) {
    CAPTURE(i);
    CHECK(relative_error(dev[i].grad(), cpu[i].grad()) < 3e-2);
  }
}

}  // namespace

TEST_SUITE("cuda_kernels") {
  TEST_CASE("bfloat16/float16 attention on tensor cores matches float64 on the CPU") {
    const std::vector<AttentionCase> cases = {
        {2, 3, 128, 128, 64, true, kBFloat16},
        {2, 3, 128, 128, 64, false, kBFloat16},
        {1, 2, 100, 100, 64, true, kBFloat16},
        {1, 2, 77, 77, 128, false, kBFloat16},
        {2, 2, 192, 192, 128, true, kFloat16},
        {1, 2, 37, 100, 64, true, kBFloat16},
        {1, 1, 130, 65, 64, true, kFloat16},
        {1, 2, 256, 256, 128, true, kBFloat16},
        // grouped-query (2 and 4 query heads per key/value head) and multi-query attention
        {2, 4, 128, 128, 64, true, kBFloat16, 2},
        {1, 8, 100, 100, 128, false, kBFloat16, 2},
        {2, 4, 192, 192, 64, true, kFloat16, 1},
        {1, 4, 37, 100, 64, true, kBFloat16, 1},
    };
    for (const char* kernel : {"weave", "cudnn"})
      for (const AttentionCase& c : cases) {
        AttentionKernel chosen(kernel);
        CAPTURE(kernel);
        CAPTURE(c.tq);
        CAPTURE(c.tk);
        CAPTURE(c.d);
        CAPTURE(c.causal);
        Generator g(c.tq * 7 + c.d);
        auto [q64, k64, v64] = attention_inputs(c, g);
        // Both sides start from the same rounded values, so only the kernel's arithmetic differs.
        std::array<Tensor, 3> cpu, dev;
        for (int i = 0; i < 3; ++i) {
          Tensor rounded = std::array{q64, k64, v64}[i].to(c.dtype).to(kFloat64);
          cpu[i] = rounded.detach().requires_grad_();
          dev[i] = rounded.to(c.dtype).to(gpu).requires_grad_();
        }
        const AttentionOptions options{.causal = c.causal};
        AttentionResult want =
            scaled_dot_product_attention_with_lse(cpu[0], cpu[1], cpu[2], options);
        AttentionResult got =
            scaled_dot_product_attention_with_lse(dev[0], dev[1], dev[2], options);
        REQUIRE(got.output.dtype() == c.dtype);
        REQUIRE(got.logsumexp.dtype() == kFloat32);
        check_attention(got, want, dev, cpu, c.dtype, g);
      }
  }

  TEST_CASE("packed documents on tensor cores match float64 on the CPU and skip no visible key") {
    struct PackedCase {
      std::vector<int64_t> lengths;  // documents of one window, in order (repeated per batch row)
      int64_t heads, kv_heads, tq, d;
      bool causal, own_query_documents;  // queries with documents of their own (tq < tk)
      DType dtype;
    };
    const std::vector<PackedCase> cases = {
        {{64, 64, 128}, 4, 4, 256, 64, true, false, kBFloat16},         // boundaries on tiles
        {{37, 100, 5, 5, 109}, 4, 2, 256, 64, true, false, kBFloat16},  // inside tiles, GQA
        {{300}, 2, 2, 300, 128, true, false, kFloat16},                 // one document
        {{3, 3, 3, 3, 3, 3, 3, 150}, 8, 2, 171, 128, false, false, kBFloat16},
        {{60, 70, 70}, 4, 1, 50, 64, true, false, kBFloat16},  // decoding: the last 50 queries
        {{90, 110}, 2, 2, 130, 64, false, true, kBFloat16},    // documents of the queries' own
    };
    Generator g(11);
    for (const PackedCase& c : cases) {
      const int64_t tk = std::accumulate(c.lengths.begin(), c.lengths.end(), int64_t{0});
      CAPTURE(tk);
      CAPTURE(c.tq);
      CAPTURE(c.causal);
      std::vector<int64_t> ids;
      for (size_t doc = 0; doc < c.lengths.size(); ++doc)
        ids.insert(ids.end(), size_t(c.lengths[doc]), int64_t(doc));
      Tensor key_docs = from_vector(ids, {1, tk}).expand({2, tk}).contiguous();
      Tensor query_docs;
      if (c.own_query_documents) {  // every other query in document 1, the rest in one no key has
        std::vector<int64_t> own(c.tq);
        for (int64_t i = 0; i < c.tq; ++i) own[i] = i % 2 ? 1 : 7;
        query_docs = from_vector(own, {1, c.tq}).expand({2, c.tq}).contiguous();
      }
      std::array<Tensor, 3> cpu, dev;
      const std::array<Shape, 3> shapes{Shape{2, c.heads, c.tq, c.d}, Shape{2, c.kv_heads, tk, c.d},
                                        Shape{2, c.kv_heads, tk, c.d}};
      for (int i = 0; i < 3; ++i) {
        Tensor rounded = randn(shapes[i], {.dtype = kFloat64}, &g).to(c.dtype).to(kFloat64);
        cpu[i] = rounded.detach().requires_grad_();
        dev[i] = rounded.to(c.dtype).to(gpu).requires_grad_();
      }
      AttentionOptions on_cpu{
          .causal = c.causal, .document_ids = key_docs, .query_document_ids = query_docs};
      AttentionOptions on_gpu = on_cpu;
      on_gpu.document_ids = key_docs.to(gpu);
      if (query_docs.defined()) on_gpu.query_document_ids = query_docs.to(gpu);
      kernels::AttentionParams params{.causal = c.causal};
      params.query_documents = on_gpu.query_document_ids.defined()
                                   ? on_gpu.query_document_ids
                                   : on_gpu.document_ids.narrow(1, tk - c.tq, c.tq).contiguous();
      params.key_documents = on_gpu.document_ids;
      REQUIRE(kernels::attention_takes_reduced(dev[0], dev[1], dev[2], Tensor(), params));
      AttentionResult want = scaled_dot_product_attention_with_lse(cpu[0], cpu[1], cpu[2], on_cpu);
      AttentionResult got = scaled_dot_product_attention_with_lse(dev[0], dev[1], dev[2], on_gpu);
      check_attention(got, want, dev, cpu, c.dtype, g);
    }
  }

  // Float32 (the blocked path where each query head has its key/value head, the fused CUDA-core
  // kernels where they group) and bfloat16 (computed in float32: the tensor-core kernels take no
  // window or soft-cap), against float64 on the CPU.
  TEST_CASE("sliding windows, soft-caps and placed queries on CUDA match float64 on the CPU") {
    struct WindowCase {
      int64_t heads, kv_heads, tq, tk, window;
      double softcap;
      std::optional<int64_t> query_start;
      DType dtype;
    };
    const std::vector<WindowCase> cases = {
        {4, 4, 200, 200, 17, 0, {}, kFloat32},  {4, 2, 200, 200, 17, 0, {}, kFloat32},
        {4, 4, 130, 130, 0, 3.0, {}, kFloat32}, {4, 1, 130, 130, 40, 2.0, {}, kFloat32},
        {2, 2, 64, 64, 30, 0, 64, kFloat32},    {2, 2, 64, 64, 0, 0, -9, kFloat32},
        {2, 1, 3, 150, 16, 0, {}, kFloat32},    {4, 2, 128, 128, 33, 5.0, {}, kBFloat16},
        {4, 4, 100, 100, 9, 0, {}, kFloat64},
    };
    Generator g(12);
    for (const WindowCase& c : cases) {
      CAPTURE(c.heads);
      CAPTURE(c.kv_heads);
      CAPTURE(c.window);
      CAPTURE(c.softcap);
      CAPTURE(int(c.dtype));
      std::array<Tensor, 3> cpu, dev;
      const std::array<Shape, 3> shapes{Shape{2, c.heads, c.tq, 64}, Shape{2, c.kv_heads, c.tk, 64},
                                        Shape{2, c.kv_heads, c.tk, 64}};
      for (int i = 0; i < 3; ++i) {
        Tensor rounded = randn(shapes[i], {.dtype = kFloat64}, &g).to(c.dtype).to(kFloat64);
        cpu[i] = rounded.detach().requires_grad_();
        dev[i] = rounded.to(c.dtype).to(gpu).requires_grad_();
      }
      const AttentionOptions options{
          .causal = true, .window = c.window, .softcap = c.softcap, .query_start = c.query_start};
      AttentionResult want = scaled_dot_product_attention_with_lse(cpu[0], cpu[1], cpu[2], options);
      AttentionResult got = scaled_dot_product_attention_with_lse(dev[0], dev[1], dev[2], options);
      const bool reduced = c.dtype == kBFloat16;
      CHECK(relative_error(got.output, want.output) < (reduced ? 2e-2 : 1e-5));
      Tensor probe = randn(want.output.shape(), {.dtype = kFloat64}, &g);
      sum(want.output * probe).backward();
      sum(got.output * probe.to(c.dtype).to(gpu)).backward();
      for (int i = 0; i < 3; ++i) {
        CAPTURE(i);
        CHECK(relative_error(dev[i].grad(), cpu[i].grad()) < (reduced ? 3e-2 : 1e-5));
      }
    }
  }

  TEST_CASE("float32 matmul: highest computes float32, high takes TF32 tensor cores") {
    Generator g(6);
    Tensor a = randn({256, 1024}, {.dtype = kFloat64}, &g),
           b = randn({1024, 192}, {.dtype = kFloat64}, &g);
    const Tensor exact = matmul(a, b);
    Tensor a32 = a.to(kFloat32).to(gpu), b32 = b.to(kFloat32).to(gpu);
    const double highest = relative_error(matmul(a32, b32), exact);
    set_float32_matmul_precision("high");
    const double high = relative_error(matmul(a32, b32), exact);
    set_float32_matmul_precision("highest");
    CAPTURE(highest);
    CAPTURE(high);
    CHECK(highest < 1e-5);       // float32 rounding over 1024 terms
    CHECK(high > 10 * highest);  // TF32 keeps 10 mantissa bits of each input ...
    CHECK(high < 5e-3);          // ... and accumulates in float32
    CHECK(relative_error(matmul(a32, b32), exact) == highest);  // back to float32
  }

  TEST_CASE("tensor-core attention gives the same bits on every run") {
    for (const char* kernel : {"weave", "cudnn", "auto"}) {
      AttentionKernel chosen(kernel);
      CAPTURE(kernel);
      Generator g(3);
      Tensor q = randn({2, 4, 200, 64}, {.dtype = kBFloat16, .device = gpu}, &g).requires_grad_();
      Tensor k = randn({2, 4, 200, 64}, {.dtype = kBFloat16, .device = gpu}, &g).requires_grad_();
      Tensor v = randn({2, 4, 200, 64}, {.dtype = kBFloat16, .device = gpu}, &g).requires_grad_();
      std::vector<Tensor> first;
      for (int run = 0; run < 2; ++run) {
        for (Tensor* t : {&q, &k, &v}) t->set_grad(Tensor());
        Tensor out = scaled_dot_product_attention(q, k, v, {.causal = true});
        sum(out.to(kFloat32) * out.to(kFloat32)).backward();
        std::vector<Tensor> now{out.cpu(), q.grad().cpu(), k.grad().cpu(), v.grad().cpu()};
        if (run == 0) first = now;
        for (size_t i = 0; run == 1 && i < now.size(); ++i) CHECK(equal(now[i], first[i]));
      }
    }
  }

  TEST_CASE("reductions split over many blocks match the CPU") {
    Generator g(11);
    // A full reduction, long rows, few long columns, many short columns: each launch shape.
    const std::vector<std::pair<Shape, Dims>> cases = {
        {{3000017}, {}},     {{4, 1000003}, {1}}, {{1000003, 3}, {0}},
        {{2048, 2048}, {0}}, {{2048, 2048}, {1}}, {{7, 50001, 5}, {1}},
    };
    for (const auto& test_case : cases) {
      // Named members, not a structured binding: clang before 16 cannot capture a binding.
      const Shape& shape = test_case.first;
      const Dims& dims = test_case.second;
      CAPTURE(shape);
      Tensor x = randn(shape, {.dtype = kFloat64}, &g);
      Tensor xg = x.to(gpu);
      CHECK(relative_error(sum(xg, dims), sum(x, dims)) < 1e-12);
      CHECK(equal(max(xg, dims).cpu(), max(x, dims)));
      CHECK(equal(min(xg, dims).cpu(), min(x, dims)));
      if (dims.size() == 1) {
        CHECK(equal(argmax(xg, dims[0]).cpu(), argmax(x, dims[0])));
        CHECK(equal(argmin(xg, dims[0]).cpu(), argmin(x, dims[0])));
      }
      Tensor xf = x.to(kFloat32), xfg = xf.to(gpu);
      CHECK(relative_error(sum(xfg, dims), sum(x, dims)) < 1e-5);
    }
    // Ties keep the first index, NaN wins, across block boundaries.
    Tensor ties = zeros({2000000});
    Tensor t = ties.to(gpu);
    CHECK(argmax(t).item<int64_t>() == 0);
    Tensor with_nan = ones({3000000});
    with_nan.narrow(0, 2999999, 1).fill_(std::nan(""));
    with_nan.narrow(0, 1234567, 1).fill_(std::nan(""));
    CHECK(argmax(with_nan.to(gpu)).item<int64_t>() == 1234567);
    CHECK(std::isnan(max(with_nan.to(gpu)).item<double>()));
    Tensor big = ones({5000000}, {.dtype = kInt64});
    CHECK(sum(big.to(gpu)).item<int64_t>() == 5000000);
  }

  TEST_CASE("layer norm's weight and bias gradients over many rows match the CPU") {
    Generator g(5);
    for (int64_t rows : {1, 255, 4099}) {
      CAPTURE(rows);
      Tensor x = randn({rows, 96}, {.dtype = kFloat64}, &g);
      Tensor w = randn({96}, {.dtype = kFloat64}, &g), b = randn({96}, {.dtype = kFloat64}, &g);
      Tensor probe = randn({rows, 96}, {.dtype = kFloat64}, &g);
      std::array<Tensor, 3> cpu{x.detach().requires_grad_(), w.detach().requires_grad_(),
                                b.detach().requires_grad_()};
      std::array<Tensor, 3> dev{x.to(gpu).requires_grad_(), w.to(gpu).requires_grad_(),
                                b.to(gpu).requires_grad_()};
      sum(layer_norm(cpu[0], {96}, cpu[1], cpu[2]) * probe).backward();
      sum(layer_norm(dev[0], {96}, dev[1], dev[2]) * probe.to(gpu)).backward();
      for (int i = 0; i < 3; ++i) CHECK(relative_error(dev[i].grad(), cpu[i].grad()) < 1e-11);
    }
  }

  TEST_CASE("layer and RMS norm match float64 on the CPU on every kernel path") {
    // Packed rows (a multiple of 8 up to 1024: 1 to 4 packs a lane), rows the packed kernels
    // leave to the block-per-row ones (not a multiple of 8, wider than 1024, off a 16-byte
    // boundary, float64 columns too many for shared memory), no weight or bias, parameter
    // gradients only (x needs none), and no rows at all (the sums are zero).
    struct NormCase {
      int64_t rows, n;
      bool rms, affine, x_grad;
      int64_t offset;  // elements before x in its storage
      DType dtype;
      double tolerance;
    };
    const NormCase cases[] = {
        {37, 8, false, true, true, 0, kFloat64, 1e-11},
        {300, 96, true, true, true, 0, kFloat32, 1e-5},
        {257, 512, false, false, true, 0, kFloat32, 1e-5},
        {4100, 768, false, true, false, 0, kFloat32, 1e-5},
        {64, 1024, false, true, true, 0, kBFloat16, 2e-2},
        {64, 1024, true, true, true, 0, kFloat64, 1e-11},
        {50, 100, false, true, true, 0, kFloat32, 1e-5},
        {40, 1032, true, true, true, 0, kFloat32, 1e-5},
        {33, 64, false, true, true, 1, kFloat32, 1e-5},
        {0, 64, false, true, true, 0, kFloat32, 0},
    };
    Generator g(11);
    for (const NormCase& c : cases) {
      CAPTURE(c.rows);
      CAPTURE(c.n);
      CAPTURE(c.rms);
      const int64_t n = c.n, numel = c.rows * n;
      Tensor storage = randn({numel + c.offset}, {.dtype = c.dtype}, &g).to(kFloat64);
      Tensor w = randn({n}, {.dtype = kFloat64}, &g), b = randn({n}, {.dtype = kFloat64}, &g);
      Tensor probe = randn({c.rows, n}, {.dtype = c.dtype}, &g).to(kFloat64);
      std::array<Tensor, 3> cpu{storage.detach().requires_grad_(c.x_grad),
                                w.detach().requires_grad_(), b.detach().requires_grad_()};
      std::array<Tensor, 3> dev{storage.to(c.dtype).to(gpu).requires_grad_(c.x_grad),
                                w.to(gpu).requires_grad_(), b.to(gpu).requires_grad_()};
      auto run = [&](const std::array<Tensor, 3>& in) {
        Tensor x = in[0].narrow(0, c.offset, numel).reshape({c.rows, n});
        const Tensor weight = c.affine ? in[1] : Tensor(), bias = c.affine ? in[2] : Tensor();
        Tensor y = c.rms ? rms_norm(x, {n}, weight) : layer_norm(x, {n}, weight, bias);
        sum(y.to(kFloat64) * probe.to(y.device())).backward();
        return y;
      };
      Tensor want = run(cpu), got = run(dev);
      if (c.rows > 0) CHECK(relative_error(got, want) <= c.tolerance);
      if (c.x_grad && c.rows > 0)
        CHECK(relative_error(dev[0].grad(), cpu[0].grad()) <= c.tolerance);
      for (int i = 1; i < (!c.affine ? 1 : c.rms ? 2 : 3); ++i) {
        CAPTURE(i);
        if (c.rows == 0) CHECK(max(abs(dev[i].grad())).item<double>() == 0);
        CHECK(relative_error(dev[i].grad(), cpu[i].grad()) <= c.tolerance);
      }
    }
  }

  TEST_CASE("bfloat16 layer and RMS norms read and write bfloat16 rows, as the CPU computes them") {
    // The CPU converts to float32 around its kernels; CUDA reads the bfloat16 rows directly:
    // the same arithmetic on the same values, in rows that fit a warp (768) and rows that
    // take a block (1500), float32 weights (autocast's master copies) and bfloat16 ones.
    Generator g(9);
    for (int64_t n : {768, 1500})
      for (DType weight_dtype : {kFloat32, kBFloat16})
        for (bool rms : {false, true}) {
          CAPTURE(n);
          CAPTURE(rms);
          Tensor x = randn({300, n}, {.dtype = kBFloat16}, &g);
          Tensor w = randn({n}, {.dtype = weight_dtype}, &g);
          Tensor b = randn({n}, {.dtype = weight_dtype}, &g);
          Tensor probe = randn({300, n}, {.dtype = kBFloat16}, &g);
          std::array<Tensor, 3> cpu{x.detach().requires_grad_(), w.detach().requires_grad_(),
                                    b.detach().requires_grad_()};
          std::array<Tensor, 3> dev{x.to(gpu).requires_grad_(), w.to(gpu).requires_grad_(),
                                    b.to(gpu).requires_grad_()};
          auto norm = [&](const std::array<Tensor, 3>& in) {
            return rms ? rms_norm(in[0], {n}, in[1]) : layer_norm(in[0], {n}, in[1], in[2]);
          };
          Tensor want = norm(cpu), got = norm(dev);
          REQUIRE(got.dtype() == kBFloat16);
          CHECK(relative_error(got, want) < 1e-2);
          sum(want.to(kFloat32) * probe.to(kFloat32)).backward();
          sum(got.to(kFloat32) * probe.to(gpu).to(kFloat32)).backward();
          for (int i = 0; i < (rms ? 2 : 3); ++i) {
            CAPTURE(i);
            REQUIRE(dev[i].grad().dtype() == cpu[i].grad().dtype());
            CHECK(relative_error(dev[i].grad(), cpu[i].grad()) < 2e-2);
          }
        }
  }

  TEST_CASE("KV-cache decoding on the GPU follows one float64 forward on the CPU") {
    // A grouped-query Llama (head dim 64, rotary positions): a 5-token prompt, then one token
    // at a time through the caches, against the whole sequence in one forward on the CPU. In
    // float64 (the blocked attention) and bfloat16 (tensor cores, one query row a step).
    Generator init(41), pick(42);
    models::Llama model({.vocab = 64,
                         .dim = 256,
                         .layers = 2,
                         .block = {.heads = 4, .kv_heads = 2},
                         .generator = &init});
    model.to(kFloat64);
    const Tensor tokens = randint(0, 64, {2, 9}, {.dtype = kInt64}, &pick);
    NoGradGuard no_grad;
    const Tensor want = model(tokens);
    model.to(gpu);
    for (auto [dtype, tolerance] : {std::pair{kFloat64, 1e-10}, std::pair{kBFloat16, 2e-2}}) {
      const DType decoded = dtype;  // a copy: CAPTURE's lambda cannot take a binding
      CAPTURE(decoded);
      model.to(dtype);
      std::vector<nn::KVCache> caches = model.make_caches(9);
      const Tensor on_gpu = tokens.to(gpu);
      std::vector<Tensor> steps{model.forward_cached(on_gpu.narrow(1, 0, 5), caches)};
      for (int64_t t = 5; t < 9; ++t)
        steps.push_back(model.forward_cached(on_gpu.narrow(1, t, 1), caches));
      const Tensor got = cat(steps, 1);
      REQUIRE(got.shape() == want.shape());
      CHECK(relative_error(got, want) < tolerance);
    }
  }

  TEST_CASE("clipping and the Adam step over many parameters match the CPU, in one launch each") {
    // Sizes on both sides of a block's chunk, more tensors than one launch's table, three
    // dtypes, two decay groups: the GPU's multi-tensor kernels against the CPU's loops.
    Generator g(5);
    const DType dtypes[] = {kFloat32, kBFloat16, kFloat64};
    const int64_t sizes[] = {1, 8191, 8192, 8193, 70001};
    std::vector<Tensor> cpu_params, gpu_params;
    for (int i = 0; i < 40; ++i) {
      const int64_t n = i < 5 ? sizes[i] : 17 * i;
      Tensor p = randn({n}, {.dtype = dtypes[i % 3]}, &g);
      cpu_params.push_back(p.clone().requires_grad_());
      gpu_params.push_back(p.to(gpu).requires_grad_());
    }
    auto groups = [](const std::vector<Tensor>& ps) {
      std::vector<optim::ParamGroup> out(2);
      for (size_t i = 0; i < ps.size(); ++i) out[i % 2].params.push_back(ps[i]);
      out[0].weight_decay = 0.1;
      return out;
    };
    optim::AdamW on_cpu(groups(cpu_params), {.lr = 0.01});
    optim::AdamW on_gpu(groups(gpu_params), {.lr = 0.01});
    for (int step = 0; step < 3; ++step) {
      for (size_t i = 0; i < cpu_params.size(); ++i) {
        Tensor grad = randn(cpu_params[i].shape(), {.dtype = cpu_params[i].dtype()}, &g);
        cpu_params[i].set_grad(grad);
        gpu_params[i].set_grad(grad.to(gpu));
      }
      for (double norm_type : {2.0, 1.0, double(INFINITY)}) {
        CAPTURE(norm_type);
        const double want = optim::clip_grad_norm_(cpu_params, INFINITY, norm_type);
        const double got = optim::clip_grad_norm_(gpu_params, INFINITY, norm_type);
        CHECK(got == doctest::Approx(want).epsilon(1e-12));
        CHECK(optim::clip_grad_norm_(gpu_params, INFINITY, norm_type) == got);  // same bits
      }
      const double want = optim::clip_grad_norm_(cpu_params, 1.0);
      CHECK(optim::clip_grad_norm_(gpu_params, 1.0) == doctest::Approx(want).epsilon(1e-12));
      for (size_t i = 0; i < cpu_params.size(); ++i) {
        CAPTURE(i);
        CHECK(relative_error(gpu_params[i].grad(), cpu_params[i].grad()) <= 1e-7);
      }
      on_cpu.step();
      on_gpu.step();
    }
    for (size_t i = 0; i < cpu_params.size(); ++i) {
      CAPTURE(i);
      CHECK(relative_error(gpu_params[i], cpu_params[i]) <= 1e-6);
    }
    // A NaN anywhere makes every norm NaN, the largest-element norm included.
    gpu_params[7].grad().fill_(std::nan(""));
    for (double norm_type : {2.0, double(INFINITY)})
      CHECK(std::isnan(optim::clip_grad_norm_(gpu_params, INFINITY, norm_type)));
  }

  TEST_CASE("memory_stats counts CUDA allocations") {
    const MemoryStats before = memory_stats(gpu);
    Tensor t = empty({1 << 20}, {.device = gpu});
    CHECK(memory_stats(gpu).in_use >= before.in_use + (size_t(4) << 20));
    CHECK(memory_stats(gpu).peak >= memory_stats(gpu).in_use);
  }

  TEST_CASE("binned and exact sums on CUDA have the CPU's bits") {
    // Terms spanning 2^-40 .. 2^40 and both signs, NaN and infinity among them: each device
    // adds 6 of them into binned sums, raises to a common window and converts; the windows, the
    // limbs, the values and an exact sum of squares must be equal, bit for bit.
    std::mt19937 rng(21);
    std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
    std::uniform_int_distribution<int> exponent(-40, 40);
    const int64_t n = 100000;
    std::vector<Tensor> terms;
    for (int t = 0; t < 6; ++t) {
      std::vector<float> values(static_cast<size_t>(n));
      for (float& v : values) v = std::ldexp(mantissa(rng), exponent(rng));
      if (t == 2) values[5] = NAN;
      if (t == 4) values[9] = INFINITY;
      terms.push_back(from_vector(values, {n}));
    }
    auto sums_on = [&](Device device) {
      Tensor window = zeros({n}, {.dtype = kUInt8, .device = device});
      Tensor limbs = zeros({2 * n}, {.dtype = kInt64, .device = device});
      for (const Tensor& t : terms) kernels::binned_add(t.to(device), window, limbs);
      std::vector<uint8_t> top = window.cpu().to_vector<uint8_t>();
      for (uint8_t& w : top) w = w == 255 ? w : std::max<uint8_t>(w, 37);  // a higher window
      kernels::binned_raise(window, limbs, from_vector(top, {n}).to(device));
      Tensor out = empty({n}, {.device = device});
      kernels::binned_value(window, limbs, 3.0, out);
      Tensor exact = zeros({kernels::common::kExactLimbs + 1}, {.dtype = kInt64, .device = device});
      kernels::exact_power_sum({terms[0].to(device), terms[1].to(device)}, 2.0, exact);
      return std::array<Tensor, 4>{window.cpu(), limbs.cpu(), out.cpu(), exact.cpu()};
    };
    const auto cpu = sums_on(kCPU), cuda = sums_on(gpu);
    CHECK(equal(cpu[0], cuda[0]));
    CHECK(equal(cpu[1], cuda[1]));
    const std::vector<float> a = cpu[2].to_vector<float>(), b = cuda[2].to_vector<float>();
    CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
    CHECK(equal(cpu[3], cuda[3]));
  }
}
