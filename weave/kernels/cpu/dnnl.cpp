// bfloat16 / float16 matmul through oneDNN (libdnnl), which runs them on AVX512-BF16 or AMX where
// the CPU has them (about twice float32's rate on AVX512-BF16; README, "Mixed precision"), with
// float32 accumulation. Primitives are built once per problem (building one costs ~0.2 ms, a
// small GEMM's whole time) and kept in a bounded cache.
#include <omp.h>

#include <map>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <optional>
#include <tuple>

#include "weave/kernels/cpu/gemm.h"
#include "weave/kernels/kernels.h"

namespace weave::kernels::cpu {

namespace {

using dnnl::memory;

// Everything a primitive depends on: dtype, dims and strides of each operand, beta.
using ProblemKey = std::tuple<DType, std::array<int64_t, 3>, std::array<int64_t, 3>,
                              std::array<int64_t, 3>, std::array<int64_t, 3>, bool>;

struct Primitive {
  dnnl::matmul matmul;
  memory::desc a, b, out;
};

struct Library {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  std::mutex mutex;
  // nullopt: oneDNN has no implementation for this problem on this CPU (float16 without
  // AVX512-FP16), remembered so the fallback is chosen without asking again.
  std::map<ProblemKey, std::optional<Primitive>> primitives;
};

Library& library() {
  static Library lib;
  return lib;
}

constexpr size_t kMaxPrimitives = 512;

memory::desc describe(DType dtype, const std::array<int64_t, 3>& dims,
                      const std::array<int64_t, 3>& strides) {
  const auto type = dtype == kBFloat16 ? memory::data_type::bf16 : memory::data_type::f16;
  return memory::desc(memory::dims(dims.begin(), dims.end()), type,
                      memory::dims(strides.begin(), strides.end()));
}

// An operand's dims and strides for oneDNN: a broadcast batch (stride 0) becomes batch 1.
std::pair<std::array<int64_t, 3>, std::array<int64_t, 3>> layout(const Tensor& t) {
  std::array<int64_t, 3> dims{t.size(0), t.size(1), t.size(2)};
  std::array<int64_t, 3> strides{t.strides()[0], t.strides()[1], t.strides()[2]};
  // size-1 dims may carry any stride; give them the dense one oneDNN expects
  if (dims[1] == 1) strides[1] = strides[2] == 1 ? dims[2] : 1;
  if (dims[2] == 1) strides[2] = strides[1] == 1 ? dims[1] : 1;
  if (strides[0] == 0 || dims[0] == 1) {
    dims[0] = 1;
    strides[0] = dims[1] * dims[2];
  }
  return {dims, strides};
}

std::optional<Primitive> build(const ProblemKey& key) {
  const auto& [dtype, a_dims, a_strides, b_dims, b_strides, accumulate] = key;
  const int64_t batch = std::max(a_dims[0], b_dims[0]);
  const std::array<int64_t, 3> c_dims{batch, a_dims[1], b_dims[2]};
  const std::array<int64_t, 3> c_strides{a_dims[1] * b_dims[2], b_dims[2], 1};
  dnnl::primitive_attr attr;
  if (accumulate) {
    dnnl::post_ops ops;
    ops.append_sum(1.0f);
    attr.set_post_ops(ops);
  }
  try {
    dnnl::matmul::primitive_desc pd(
        dnnl::matmul::desc(describe(dtype, a_dims, a_strides), describe(dtype, b_dims, b_strides),
                           describe(dtype, c_dims, c_strides)),
        attr, library().engine);
    return Primitive{dnnl::matmul(pd), pd.src_desc(), pd.weights_desc(), pd.dst_desc()};
  } catch (const dnnl::error&) {
    return std::nullopt;
  }
}

}  // namespace

bool reduced_precision_matmul(const Tensor& a, const Tensor& b, const Tensor& out,
                              bool accumulate) {
  const auto [a_dims, a_strides] = layout(a);
  const auto [b_dims, b_strides] = layout(b);
  // Both batches broadcast against a batched output (rare: the front end copies instead).
  if (out.size(0) > 1 && (a_dims[0] == 1) && (b_dims[0] == 1)) return false;
  const ProblemKey key{a.dtype(), a_dims, a_strides, b_dims, b_strides, accumulate};
  Library& lib = library();
  std::optional<Primitive> primitive;
  {
    std::lock_guard lock(lib.mutex);
    auto found = lib.primitives.find(key);
    if (found == lib.primitives.end()) {
      if (lib.primitives.size() >= kMaxPrimitives) lib.primitives.clear();
      found = lib.primitives.emplace(key, build(key)).first;
    }
    primitive = found->second;
  }
  if (!primitive) return false;
  memory ma(primitive->a, lib.engine, a.data_ptr());
  memory mb(primitive->b, lib.engine, b.data_ptr());
  memory mc(primitive->out, lib.engine, out.data_ptr());
  // oneDNN's OpenMP runtime uses the calling thread's setting: weave's budget for this call.
  const int previous = omp_get_max_threads();
  omp_set_num_threads(max_threads());
  thread_local dnnl::stream stream(lib.engine);
  primitive->matmul.execute(stream,
                            {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}});
  stream.wait();
  omp_set_num_threads(previous);
  return true;
}

}  // namespace weave::kernels::cpu
