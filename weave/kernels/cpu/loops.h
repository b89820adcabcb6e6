#pragma once
// The strided loop behind every CPU elementwise kernel. Operands share one shape (inputs are
// broadcast views); dimensions that are contiguous for every operand are merged, and the
// innermost run is handed to a typed row body, in parallel when the work is large.
#include <omp.h>

#include <array>
#include <tuple>
#include <utility>

#include "weave/kernels/kernels.h"
#include "weave/tensor/tensor.h"

namespace weave::kernels::cpu {

/// Below this many elements a loop stays on one thread.
inline constexpr int64_t kParallelGrain = 32768;

/// Threads worth using for `work` elements: one below kParallelGrain, else the budget.
inline int threads_for(int64_t work) {
  return work >= kParallelGrain ? max_threads() : 1;
}

/// Splits [0, n) into one contiguous range per thread of the budget (one below
/// kParallelGrain) and calls range(begin, count) for each.
template <class Range>
void for_ranges(int64_t n, const Range& range) {
  const int threads = threads_for(n);
  const int64_t chunk = (n + threads - 1) / threads;
#pragma omp parallel for num_threads(threads) if (threads > 1)
  for (int t = 0; t < threads; ++t) {
    const int64_t begin = t * chunk, count = std::min(chunk, n - begin);
    if (count > 0) range(begin, count);
  }
}

template <size_t N>
struct StridedLoop {
  int rank = 0;
  int64_t shape[kMaxDims];
  int64_t strides[N][kMaxDims];  // bytes
  char* base[N];

  explicit StridedLoop(const std::array<const Tensor*, N>& tensors) {
    const Shape& full = tensors[0]->shape();
    for (size_t k = 0; k < N; ++k) base[k] = static_cast<char*>(tensors[k]->data_ptr());
    for (int d = 0; d < full.size(); ++d) {
      if (full[d] == 1) continue;  // size-1 dims never move a pointer
      bool merge = rank > 0;
      for (size_t k = 0; k < N && merge; ++k) {
        int64_t stride = tensors[k]->strides()[d] * int64_t(tensors[k]->itemsize());
        merge = strides[k][rank - 1] == stride * full[d];
      }
      if (merge) {
        shape[rank - 1] *= full[d];
        for (size_t k = 0; k < N; ++k)
          strides[k][rank - 1] = tensors[k]->strides()[d] * int64_t(tensors[k]->itemsize());
      } else {
        shape[rank] = full[d];
        for (size_t k = 0; k < N; ++k)
          strides[k][rank] = tensors[k]->strides()[d] * int64_t(tensors[k]->itemsize());
        ++rank;
      }
    }
    if (rank == 0) {  // a scalar, or all dims of size 1
      shape[0] = 1;
      for (size_t k = 0; k < N; ++k) strides[k][0] = 0;
      rank = 1;
    }
  }

  /// Calls body(ptrs, inner_byte_strides, count) for every run of the innermost dimension.
  template <class Body>
  void run(const Body& body) const {
    const int64_t inner = shape[rank - 1];
    int64_t rows = 1;
    for (int d = 0; d < rank - 1; ++d) rows *= shape[d];
    std::array<int64_t, N> inner_strides;
    for (size_t k = 0; k < N; ++k) inner_strides[k] = strides[k][rank - 1];
    const int threads = threads_for(rows * inner);
    const bool parallel = threads > 1;
    if (rows == 1) {  // one long run: split it into chunks
      for_ranges(inner, [&](int64_t begin, int64_t count) {
        std::array<char*, N> ptrs;
        for (size_t k = 0; k < N; ++k) ptrs[k] = base[k] + begin * inner_strides[k];
        body(ptrs, inner_strides, count);
      });
      return;
    }
#pragma omp parallel for num_threads(threads) if (parallel)
    for (int64_t row = 0; row < rows; ++row) {
      std::array<char*, N> ptrs = {};
      for (size_t k = 0; k < N; ++k) ptrs[k] = base[k];
      int64_t rest = row;
      for (int d = rank - 2; d >= 0; --d) {
        int64_t i = rest % shape[d];
        rest /= shape[d];
        for (size_t k = 0; k < N; ++k) ptrs[k] += i * strides[k][d];
      }
      body(ptrs, inner_strides, inner);
    }
  }
};

template <class>
struct TensorFor {
  using type = Tensor;
};

/// out = f(ins...) elementwise; f takes and returns compute types.
template <class TO, class... TI, class F>
void map(const F& f, const Tensor& out, const typename TensorFor<TI>::type&... ins) {
  constexpr size_t N = 1 + sizeof...(TI);
  StridedLoop<N> loop({&out, &ins...});
  loop.run([&](const std::array<char*, N>& p, const std::array<int64_t, N>& s, int64_t n) {
    [&]<size_t... I>(std::index_sequence<I...>) {
      bool contiguous = s[0] == int64_t(sizeof(TO)) && ((s[I + 1] == int64_t(sizeof(TI))) && ...);
      if constexpr (sizeof...(TI) == 2) {
        // A binary op with one scalar operand (x * 2.0, a sum divided by n): the scalar is
        // read once, so the loop vectorizes like the contiguous one.
        using A = std::tuple_element_t<0, std::tuple<TI...>>;
        using B = std::tuple_element_t<1, std::tuple<TI...>>;
        if (!contiguous && s[0] == int64_t(sizeof(TO))) {
          TO* o = reinterpret_cast<TO*>(p[0]);
          if (s[1] == int64_t(sizeof(A)) && s[2] == 0) {
            const A* a = reinterpret_cast<const A*>(p[1]);
            const auto b = compute_t<B>(*reinterpret_cast<const B*>(p[2]));
            for (int64_t i = 0; i < n; ++i) o[i] = TO(f(compute_t<A>(a[i]), b));
            return;
          }
          if (s[1] == 0 && s[2] == int64_t(sizeof(B))) {
            const auto a = compute_t<A>(*reinterpret_cast<const A*>(p[1]));
            const B* b = reinterpret_cast<const B*>(p[2]);
            for (int64_t i = 0; i < n; ++i) o[i] = TO(f(a, compute_t<B>(b[i])));
            return;
          }
        }
      }
      if (contiguous) {
        TO* o = reinterpret_cast<TO*>(p[0]);
        std::tuple<const TI*...> in{reinterpret_cast<const TI*>(p[I + 1])...};
        for (int64_t i = 0; i < n; ++i) o[i] = TO(f(compute_t<TI>(std::get<I>(in)[i])...));
      } else {
        for (int64_t i = 0; i < n; ++i)
          *reinterpret_cast<TO*>(p[0] + i * s[0]) =
              TO(f(compute_t<TI>(*reinterpret_cast<const TI*>(p[I + 1] + i * s[I + 1]))...));
      }
    }
    (std::index_sequence_for<TI...>{});
  });
}

/// The strided loops as common/elementwise.h's Map.
struct LoopMap {
  template <class TO, class... TI, class F>
  static void run(const F& f, const Tensor& out, const typename TensorFor<TI>::type&... ins) {
    map<TO, TI...>(f, out, ins...);
  }
};

}  // namespace weave::kernels::cpu
